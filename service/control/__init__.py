"""Submitting, cancelling and following jobs: the store on one side, Ray on the other.

Split by concern: admission (may this spec run here?), the queued rows (jobs waiting with
no process, booked with the cluster's scheduler), the supervisors (launching, finding and
re-creating each job's supervisor), the event pump (each supervisor's events into the
store), and maintenance (wall-time limits, retention, the scheduler's quotas). The routes
call :class:`JobControl`; which status code each refusal gets is the routes' and
``service/problems.py``'s business.
"""

from service.control.commands import JobControl

__all__ = ["JobControl"]
