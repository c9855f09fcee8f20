"""Base settings, driven by environment variables (see docs/CONFIGURATION.md).

Integrations each have their own module, imported at the end.
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url

from sluice.settings.env import env_bool, env_int, env_list, env_secret, env_str

REPO_DIR = Path(__file__).resolve().parents[3]
# Local state that must never be committed: generated secrets, JWT signing keys, the
# zero-setup SQLite database, the demo credentials. Ignored by git.
STATE_DIR = Path(env_str("SLUICE_STATE_DIR", str(REPO_DIR / "var")))

SECRET_KEY = env_secret("SLUICE_SECRET_KEY", state_dir=STATE_DIR)
DEBUG = env_bool("SLUICE_DEBUG", False)
ALLOWED_HOSTS = env_list("SLUICE_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
PUBLIC_URL = env_str("SLUICE_PUBLIC_URL", "http://127.0.0.1:8000").rstrip("/")

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "ninja",
    "tenants",
    "governance",
    "inference",
    "streaming",
    "frontend",
]

MIDDLEWARE = [
    "sluice.middleware.TelemetryMiddleware",
    "sluice.middleware.JsonErrorMiddleware",
    "sluice.middleware.BodySizeLimitMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "sluice.middleware.UiSecurityHeadersMiddleware",
    "sluice.middleware.SecureCookiesMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "sluice.root.urls"
ASGI_APPLICATION = "sluice.root.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# DATABASE_URL selects the database (PostgreSQL in production and CI); SQLite under the
# state dir is the zero-setup default of the run command.
DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{STATE_DIR / 'sluice.sqlite3'}"),
        conn_max_age=env_int("SLUICE_DB_CONN_MAX_AGE", 60, minimum=0),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes write the one file (the gateways, the audit writer, the UI). A
    # deferred transaction that reads and then writes cannot upgrade its lock while
    # another writer commits, and SQLite fails it at once ("database is locked")
    # instead of waiting; IMMEDIATE takes the write lock at BEGIN, so writers queue (up
    # to `timeout` seconds) and none fails.
    DATABASES["default"]["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 20}
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A database that stops answering (a failover to a new address, a dropped route)
    # would hold each new connection for the kernel's TCP timeout, about two minutes:
    # bound it, so a caller gets the retriable 503 instead of a hang.
    DATABASES["default"].setdefault("OPTIONS", {})["connect_timeout"] = env_int(
        "SLUICE_DB_CONNECT_TIMEOUT_S", 5, minimum=1)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
     "OPTIONS": {"min_length": 12}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = STATE_DIR / "static"

# Request bodies on the management API: 1 MiB. Larger bodies get 413 before parsing.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("SLUICE_MAX_BODY_BYTES", 1024 * 1024, minimum=1024)

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
# Cookies are Secure on every HTTPS request (sluice.middleware.SecureCookiesMiddleware);
# these force it on plain HTTP too, by default when the public URL is https.
SESSION_COOKIE_SECURE = env_bool("SLUICE_SECURE_COOKIES", PUBLIC_URL.startswith("https://"))
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
# Behind a TLS-terminating proxy that sets X-Forwarded-Proto (and strips a client's):
# trust it, so request.is_secure() (Secure cookies, CSRF's origin checks) sees https.
if env_bool("SLUICE_TRUST_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# The admin UI's policy (sluice.middleware.UiSecurityHeadersMiddleware): its own script
# and stylesheet, nothing inline, no framing, forms and fetches to itself only.
SLUICE_UI_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; "
                 "img-src 'self' data:; connect-src 'self'; object-src 'none'; "
                 "base-uri 'none'; frame-ancestors 'none'; form-action 'self'")

NINJA_PAGINATION_MAX_LIMIT = 100
NINJA_PAGINATION_PER_PAGE = 50

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
                   "json": {"()": "sluice.observability.telemetry.JsonFormatter"}},
    # Every record passes the redaction engine before a handler writes it.
    "filters": {"redact": {"()": "sluice.pii.logredact.RedactingFilter"}},
    "handlers": {"console": {"class": "logging.StreamHandler",
                             "formatter": "plain" if env_str("SLUICE_LOG_FORMAT", "json") == "text"
                             else "json",
                             "filters": ["redact"]}},
    "root": {"handlers": ["console"], "level": env_str("SLUICE_LOG_LEVEL", "INFO")},
    # django.request logs 4xx with the request line; our error bodies already say enough.
    "loggers": {"django.request": {"level": "ERROR"}},
}

from sluice.settings.auth import *  # noqa: E402, F403
from sluice.settings.celery import *  # noqa: E402, F403
from sluice.settings.channels import *  # noqa: E402, F403
from sluice.settings.governance import *  # noqa: E402, F403
from sluice.settings.inference import *  # noqa: E402, F403
from sluice.settings.redis import *  # noqa: E402, F403
from sluice.settings.telemetry import *  # noqa: E402, F403
from sluice.settings.tls import *  # noqa: E402, F403

SLUICE_JWT_ISSUER = SLUICE_JWT_ISSUER or PUBLIC_URL  # noqa: F405
SLUICE_JWT_KEYS_DIR = SLUICE_JWT_KEYS_DIR or str(STATE_DIR / "jwt_keys")  # noqa: F405
