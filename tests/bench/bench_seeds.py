"""What bench_apis.py seeds each side with, and the 1 KB prompt of its "chat 1k" modes."""

from __future__ import annotations

# About 1 KB of a support conversation's text, an e-mail address and a phone number in it.
KB = [{"role": "user", "content": (
    "Hello, I am writing about order 55102 which arrived damaged last Tuesday. The box was "
    "crushed on one corner and two of the four glasses inside were broken; the other two "
    "have small chips near the rim. I have photos of the packaging and of the glasses and "
    "can send them if that helps. I would prefer a replacement to a refund, since the set "
    "was a gift and the recipient's birthday is at the end of the month. If a replacement "
    "is not possible in time, a refund to the original card is fine. Please reach me at "
    "jordan.miller@example.com or on +44 20 7946 0958 between nine and five on weekdays. "
    "I also noticed that the tracking page still shows the parcel as in transit, which "
    "seems wrong, so you may want to tell the carrier. Thank you for your help, and "
    "sorry for the long message; I wanted to give you everything at once so that we do "
    "not need to go back and forth. Kind regards, Jordan. P.S. The invoice number is "
    "INV-2231-884 if you need it for your records.")}]
GUARDED = "chat 1k pii"
SEED = ("import django; django.setup(); from django.core.management import call_command; "
        "call_command('migrate', verbosity=0); from tenants.services import demo_seed; "
        "from inference.services import deployment_seed_defaults; "
        "deployment_seed_defaults(); print(demo_seed().api_key); "
        # bench_http.govern_demo's policies, with values PostgreSQL's columns hold
        "from governance.models import Quota, RateLimitPolicy as R; "
        "from tenants.models import Tenant; t = Tenant.objects.get(slug='demo'); "
        "R.objects.create(scope='tenant', tenant=t, requests_per_minute=10**8, "
        "tokens_per_minute=10**9); R.objects.create(scope='model', tenant=t, "
        "requests_per_minute=10**8, adaptive=True, qps_ref=1); "
        "Quota.objects.create(tenant=t, max_tokens=10**12)")
# With the budget mode: echo gets a price (every mode's calls are priced, so that the
# budget is the one difference), and a second key a monthly budget no run reaches.
BUDGET_SEED = (
    "; from decimal import Decimal; import datetime as dt; "
    "from governance.models import Budget, Price; from tenants.models import ApiKey; "
    "Price.objects.create(model='echo', input_per_mtok_usd=Decimal('0.5'), "
    "output_per_mtok_usd=Decimal('1.5'), valid_from=dt.datetime(2026, 1, 1, "
    "tzinfo=dt.timezone.utc)); second = demo_seed().api_key; "
    "Budget.objects.create(tenant=t, scope='key', api_key=ApiKey.objects.order_by('-id')"
    ".first(), window='month', limit_usd=Decimal('999999')); print(second)")
# With the guarded mode: another key, with a pre-call PII policy that masks.
GUARD_SEED = (
    "; from tenants.models import ApiKey; guarded = demo_seed().api_key; "
    "from governance.guardrail_models import GuardrailPolicy; "
    "GuardrailPolicy.objects.create(tenant=t, name='pii', guard='pii', phase='pre', "
    "action='mask', scope='key', api_key=ApiKey.objects.order_by('-id').first()); "
    "print(guarded)")
# bench_guard_ttft.py's: echo writes a token every 2 ms, and another key's replies go
# through a post-call PII policy that masks (held back a window).
POST_SEED = (
    "; from tenants.models import ApiKey; from inference.models import Deployment; "
    "Deployment.objects.filter(name='echo').update(echo_token_delay_ms=2); "
    "post = demo_seed().api_key; "
    "from governance.guardrail_models import GuardrailPolicy; "
    "GuardrailPolicy.objects.create(tenant=t, name='pii-out', guard='pii', phase='post', "
    "action='mask', scope='key', api_key=ApiKey.objects.order_by('-id').first()); "
    "print(post)")
POSTED = "ttft post pii"
# Modes whose calls use a key of their own: the seed that prints it, and the file a
# revision must have for it (else the mode uses the side's plain key).
KEYED = {"chat budget": (BUDGET_SEED, "governance/pricing.py"),
         GUARDED: (GUARD_SEED, "governance/guardrail_models.py"),
         POSTED: (POST_SEED, "governance/guardrail_models.py")}


