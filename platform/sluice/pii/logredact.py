"""A logging filter that redacts every record (message, arguments, exception text)
before any handler formats it, so personal data and secrets never reach log output."""

from __future__ import annotations

import logging

from sluice.pii.redaction import redact


class RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: log it as it came
            message = str(record.msg)
        record.msg, record.args = redact(message), None
        if record.exc_info:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text, record.exc_info = redact(text), None
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True
