#!/usr/bin/env python3
"""Push chat jobs to llm-worker and wait for their results, with redis-py.

    pip install 'redis>=5'
    REDIS_URL=redis://127.0.0.1:6379 NAMESPACE=llm python3 producer_consumer.py

Producer: one XADD per job into {ns}:jobs, field `payload` = the JSON job, with an `id`
so the result can be found (and so a job pushed twice is answered once).
Consumer: reads {ns}:results from the position taken *before* pushing (so no result is
missed, however fast the worker is) and keeps the results of our ids.

Prints one line per job, in the order pushed: `<id> <status> <model> <cost_usd> <content>`.
Exit status 0 when every job ended `ok`, 1 otherwise, 2 on a timeout.
"""

import json
import os
import sys
import time
import uuid

import redis

url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
ns = os.environ.get("NAMESPACE", "llm")
timeout_s = float(os.environ.get("TIMEOUT_S", "60"))
jobs_key, results_key = f"{{{ns}}}:jobs", f"{{{ns}}}:results"

r = redis.Redis.from_url(url, decode_responses=True)

# Where the results stream ends now: every result of the jobs below comes after it.
last = r.xinfo_stream(results_key)["last-generated-id"] if r.exists(results_key) else "0-0"

run = uuid.uuid4().hex[:8]
prompts = ["Say hello in French.", "Name a prime number.", "What is Redis?"]
ids = []
for i, prompt in enumerate(prompts):
    job_id = f"py-{run}-{i}"
    job = {
        "id": job_id,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 64,
        "metadata": {"example": "python"},
    }
    r.xadd(jobs_key, {"payload": json.dumps(job)})
    ids.append(job_id)

results = {}
deadline = time.monotonic() + timeout_s
while len(results) < len(ids):
    left_ms = int((deadline - time.monotonic()) * 1000)
    if left_ms <= 0:
        print(f"timed out: {len(results)} of {len(ids)} results", file=sys.stderr)
        sys.exit(2)
    for _stream, entries in r.xread({results_key: last}, block=min(left_ms, 1000)) or []:
        for entry_id, fields in entries:
            last = entry_id
            if fields.get("job_id") in ids:
                results[fields["job_id"]] = fields

for job_id in ids:
    f = results[job_id]
    detail = f.get("content", "") if f["status"] == "ok" else f.get("error", "")
    print(job_id, f["status"], f.get("model", "-"), f["cost_usd"], detail.replace("\n", " ")[:60])
sys.exit(0 if all(results[i]["status"] == "ok" for i in ids) else 1)
