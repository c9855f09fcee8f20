"""The parts of a worker (inference/worker.py wires them; each module states its
contract), in the shape of vLLM v1's engine:

    entries.py  a held queue entry (`Pending`) and a request's failure (`RequestError`)
    intake.py   reading entries, reaping dead workers' entries, dead letters, the
                backlog, cancel flags, what an earlier delivery streamed
    batch_scheduler.py  which backlog entries start now, which running ones give way
    scheduler.py  the policy it asks: which waiting requests are admitted (pure)
    inputs.py   a job into the engine's sequence: prompt, sampling, grammar
    engine.py   the runtime's sequences and steps, overlapped on the model thread
    output.py   tokens into events: detokenizing (detokenize.py), stop strings,
                logprobs (logprobs.py), finishes
    writer.py   the outbox and the writer thread: events, each final once, acks
    health.py   heartbeats, the memory guard (memory.py), batch spans
The grammar a request's output must follow is inference/structured/'s.

What crosses between parts is typed: `Pending` entries, token dicts
({request id: token}), and the jobs and events of inference/jobs.py.
"""
