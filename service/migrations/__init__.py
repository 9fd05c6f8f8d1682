"""Alembic migrations of the store's schema; run by the service at start-up."""
