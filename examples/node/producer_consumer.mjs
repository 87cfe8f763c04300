// Push chat jobs to llm-worker and wait for their results, with node-redis.
//
//   npm install            (in this folder: installs `redis`)
//   REDIS_URL=redis://127.0.0.1:6379 NAMESPACE=llm node producer_consumer.mjs
//
// Producer: one XADD per job into {ns}:jobs, field `payload` = the JSON job, with an `id`.
// Consumer: reads {ns}:results from the position taken *before* pushing (so no result is
// missed) and keeps the results of our ids.
//
// Prints one line per job, in the order pushed: `<id> <status> <model> <cost_usd> <content>`.
// Exit status 0 when every job ended `ok`, 1 otherwise, 2 on a timeout.

import { createClient } from "redis";
import { randomUUID } from "node:crypto";

const url = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
const ns = process.env.NAMESPACE ?? "llm";
const timeoutMs = Number(process.env.TIMEOUT_S ?? "60") * 1000;
const jobsKey = `{${ns}}:jobs`;
const resultsKey = `{${ns}}:results`;

const r = createClient({ url });
await r.connect();

// Where the results stream ends now: every result of the jobs below comes after it.
let last = (await r.exists(resultsKey))
  ? (await r.xInfoStream(resultsKey)).lastGeneratedId
  : "0-0";

const run = randomUUID().slice(0, 8);
const prompts = ["Say hello in French.", "Name a prime number.", "What is Redis?"];
const ids = [];
for (const [i, prompt] of prompts.entries()) {
  const id = `node-${run}-${i}`;
  const job = {
    id,
    messages: [{ role: "user", content: prompt }],
    max_tokens: 64,
    metadata: { example: "node" },
  };
  await r.xAdd(jobsKey, "*", { payload: JSON.stringify(job) });
  ids.push(id);
}

const results = new Map();
const deadline = Date.now() + timeoutMs;
while (results.size < ids.length) {
  const left = deadline - Date.now();
  if (left <= 0) {
    console.error(`timed out: ${results.size} of ${ids.length} results`);
    await r.quit();
    process.exit(2);
  }
  const got = await r.xRead({ key: resultsKey, id: last }, { BLOCK: Math.min(left, 1000) });
  for (const stream of got ?? []) {
    for (const { id: entryId, message } of stream.messages) {
      last = entryId;
      if (ids.includes(message.job_id)) results.set(message.job_id, message);
    }
  }
}

for (const id of ids) {
  const f = results.get(id);
  const detail = f.status === "ok" ? (f.content ?? "") : (f.error ?? "");
  console.log(id, f.status, f.model ?? "-", f.cost_usd, detail.replaceAll("\n", " ").slice(0, 60));
}
await r.quit();
process.exit(ids.every((id) => results.get(id).status === "ok") ? 0 : 1);
