"""fleetgen workers: `celery -A workers worker -Q gpu0`."""

from workers.app import app

__all__ = ["app"]
