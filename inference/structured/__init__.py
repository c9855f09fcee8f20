"""Structured generation: output held to a grammar (tool calls, response formats).

    grammar.py        the grammar of a request's reply, compiled by llguidance
                      (torch-free: the gateway validates with it before queueing)
    grammar_check.py  a grammar checked in a bounded child process (the gateway)
    constraint.py     a running row's matcher: which tokens may come next (the worker)
    masks.py          those choices as token masks for a batch (the runtimes' sampling)
    toolstream.py     the tool calls read back out of the text while it is written
"""
