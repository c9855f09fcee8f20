"""Guardrails: policies (governance/guardrail_models.py) and the guards that run them.

    policy.py   the hot path's copy of a policy row, and which policies a call gets
    guards.py   the guard contract and the span guards (pii, words)
    webhook.py  the webhook guard (LiteLLM's generic guardrail API)
    runner.py   one phase's policies over a call's texts: timeouts, failure modes,
                shadow, verdict notes and metrics
    holdback.py a streamed reply held back and scanned incrementally
    services.py, api.py  the management API (/api/v1/governance/guardrails)

The call pipeline runs them (streaming/pipeline/guarding.py); docs/GUARDRAILS.md is
the user's page.
"""
