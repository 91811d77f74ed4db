"""Jobs that outlive their connection, and outputs that outlive their replica.

* `store.py`: `Store` keeps job records, the prepared requests that make them, and output files
  on a file system every ingress replica shares: a local directory by default, any fsspec URL
  for a cluster.
* `runner.py`: `JobRunner` runs an ingress's jobs as asyncio tasks, renews their leases,
  resumes jobs whose ingress went away, prunes old outputs, and calls webhooks.
* `webhooks.py`: which webhook targets are allowed; the signed POST of a job.
* `links.py`: signed links to stored outputs.
"""

from serve_app.jobs.links import sign, signature_ok
from serve_app.jobs.runner import JobRunner, Stream, new_job_request_id
from serve_app.jobs.store import JOB_PREFIX, Store, body_hash, job_id_for

__all__ = [
    "JOB_PREFIX",
    "JobRunner",
    "Store",
    "Stream",
    "body_hash",
    "job_id_for",
    "new_job_request_id",
    "sign",
    "signature_ok",
]
