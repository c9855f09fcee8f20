"""The Sluice Django project. The Celery app loads with Django, so that tasks dispatched
from requests (`.delay()`) go to the configured broker."""

from sluice.celery import app as celery_app

__all__ = ["celery_app"]
