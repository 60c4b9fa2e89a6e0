#!/usr/bin/env python
"""The official openai client through the whole Batch API of a running server (the default model):
upload, create, poll, download output and error files; a second batch cancelled midway.

    llamabatch serve -m gemma3-270m --parallel 8 &
    python scripts/batch_api_sdk.py http://127.0.0.1:8000/v1
"""
import io, json, sys, time
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1], api_key="unused")
def upload(rows):
    return c.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())), purpose="batch")
def wait(b, until=("completed", "failed", "cancelled", "expired")):
    while (b := c.batches.retrieve(b.id)).status not in until: time.sleep(0.5)
    return b
rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gemma3-270m", "messages": [{"role": "user", "content": f"Name a fruit that starts with the letter {'ABCDEFGHIJ'[i % 10]}."}], "max_tokens": 12, "temperature": 0}}
        for i in range(20)]
rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gemma3-270m", "messages": [], "max_tokens": 4}})
t0 = time.time()
b = c.batches.create(input_file_id=upload(rows).id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "sdk"})
print("created", b.id, b.status)
b = wait(b)
print("final", b.status, b.request_counts, f"{time.time()-t0:.1f}s", "usage", b.usage.input_tokens, b.usage.output_tokens)
out = [json.loads(l) for l in c.files.content(b.output_file_id).text.splitlines()]
err = [json.loads(l) for l in c.files.content(b.error_file_id).text.splitlines()]
print("output lines", len(out), "e.g.", out[0]["custom_id"], repr(out[0]["response"]["body"]["choices"][0]["message"]["content"]))
print("error lines", len(err), err[0]["custom_id"], err[0]["response"]["status_code"], err[0]["error"]["message"])
long = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gemma3-270m", "prompt": f"Story {i}:", "max_tokens": 64, "temperature": 0, "ignore_eos": True}} for i in range(200)]
b2 = c.batches.create(input_file_id=upload(long).id, endpoint="/v1/completions", completion_window="24h")
while c.batches.retrieve(b2.id).request_counts.completed < 10: time.sleep(0.5)
print("cancel ->", c.batches.cancel(b2.id).status)
b2 = wait(b2)
part = c.files.content(b2.output_file_id).text.splitlines()
print("cancelled", b2.status, b2.request_counts, "partial output lines", len(part),
      "all whole:", all(json.loads(l)["response"]["body"]["usage"]["completion_tokens"] == 64 for l in part))
print("batches listed", [x.id for x in c.batches.list(limit=5)])
