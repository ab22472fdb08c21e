// The README walkthroughs, through a client generated from openapi/openapi.json
// (openapi-typescript writes the types, openapi-fetch makes the calls).
//
//   npm ci && npm run generate && npm run build
//   HOLDFAST_URL=http://127.0.0.1:7427 HOLDFAST_TOKEN=... npm run walkthrough
//
// Every step checks what the server answered, and `tsc --strict` checks every
// call against the document: a document change that breaks the generated
// types breaks the build.

import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import createClient from "openapi-fetch";

import type { components, paths } from "../generated/holdfast.js";

type Lease = components["schemas"]["Lease"];
type Process = components["schemas"]["Process"];
type EventType = components["schemas"]["EventType"];

const baseUrl = process.env.HOLDFAST_URL ?? "http://127.0.0.1:7427";
const token = process.env.HOLDFAST_TOKEN;
const client = createClient<paths>({
  baseUrl,
  headers: token ? { Authorization: `Bearer ${token}` } : {},
});

/** Acquire, meet a conflict, renew, release. */
async function leases(resource: string): Promise<Lease> {
  // An Idempotency-Key makes the request safe to retry after a timeout or a 503.
  const request = {
    params: { header: { "Idempotency-Key": `walkthrough-${randomUUID()}` } },
    body: {
      resource,
      holder: "supervisor-1",
      ttl_ms: 30_000,
      metadata: { example: "typescript", pid: process.pid },
    },
  };
  const acquired = await client.POST("/v1/leases", request);
  assert.equal(acquired.response.status, 201, JSON.stringify(acquired.error));
  const lease = acquired.data;
  assert.ok(lease);
  // The retry is answered the first answer again; nothing is acquired twice.
  const retried = await client.POST("/v1/leases", request);
  assert.equal(retried.response.headers.get("idempotent-replayed"), "true");
  assert.equal(retried.data?.id, lease.id);
  assert.equal(lease.state, "active");
  assert.equal(lease.metadata["example"], "typescript");
  console.log(`acquired ${lease.resource} with token ${lease.token}, expires ${lease.expires_at}`);

  // A second holder is refused: the problem's code and holder are typed.
  const refused = await client.POST("/v1/leases", {
    body: { resource, holder: "supervisor-2", ttl_ms: 30_000 },
  });
  const problem = refused.error;
  assert.equal(refused.response.status, 409);
  assert.ok(problem);
  assert.equal(problem.code, "lease_held");
  assert.equal(problem.holder?.token, lease.token);
  console.log(`${problem.code}: ${problem.detail} (holder ${problem.holder?.holder}, token ${problem.holder?.token})`);

  const params = { path: { id: lease.id } };
  const renewed = await client.POST("/v1/leases/{id}/renew", {
    params,
    body: { token: lease.token, ttl_ms: 60_000 },
  });
  assert.ok(renewed.data, JSON.stringify(renewed.error));
  assert.equal(renewed.data.ttl_ms, 60_000);
  assert.ok((renewed.data.expires_at ?? "") > (lease.expires_at ?? ""));
  console.log(`renewed until ${renewed.data.expires_at}`);

  const released = await client.POST("/v1/leases/{id}/release", {
    params,
    body: { token: lease.token },
  });
  assert.equal(released.data?.state, "released", JSON.stringify(released.error));
  // A stale token is fenced, and the problem shows the lease as it is now.
  const fenced = await client.POST("/v1/leases/{id}/renew", {
    params,
    body: { token: lease.token },
  });
  assert.equal(fenced.error?.code, "fenced");
  console.log(`released; renewing again is ${fenced.error?.code}`);
  return released.data;
}

/** Spawn a dev server with a port, read its output, stop it. */
async function processes(): Promise<Process> {
  const spawned = await client.POST("/v1/processes", {
    body: {
      kind: "dev-server",
      command: { argv: ["sh", "-c", 'echo "listening on $PORT_HTTP"; exec sleep 30'] },
      ports: ["http"],
    },
  });
  const proc = spawned.data;
  assert.ok(proc, JSON.stringify(spawned.error));
  assert.equal(proc.state, "running");
  const port = proc.ports["http"];
  assert.ok(port !== undefined && port > 0);
  console.log(`spawned pid ${proc.pid} with port http=${port}`);

  const params = { path: { id: proc.id } };
  const expected = `listening on ${port}`;
  const deadline = Date.now() + 10_000;
  let output = "";
  while (!output.includes(expected)) {
    assert.ok(Date.now() < deadline, `no output: ${JSON.stringify(output)}`);
    const logs = await client.GET("/v1/processes/{id}/logs", { params, parseAs: "text" });
    assert.ok(logs.data !== undefined, JSON.stringify(logs.error));
    output = logs.data;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  console.log(`its output: ${JSON.stringify(output.trim())}`);

  const stopped = await client.POST("/v1/processes/{id}/stop", {
    params,
    body: { token: proc.token, grace_ms: 2000 },
  });
  assert.ok(stopped.data, JSON.stringify(stopped.error));
  assert.equal(stopped.data.state, "stopped");
  assert.equal(stopped.data.exit.signal, 15);
  assert.deepEqual(stopped.data.ports, {}, "its port was released");
  console.log(`stopped: signal ${stopped.data.exit.signal}`);
  return stopped.data;
}

/** The ordered log of what happened above. */
async function events(lease: Lease, proc: Process): Promise<void> {
  const seen: EventType[] = [];
  let after = 0;
  for (;;) {
    const page = await client.GET("/v1/events", { params: { query: { after, limit: 1000 } } });
    assert.ok(page.data, JSON.stringify(page.error));
    if (page.data.items.length === 0) break;
    for (const event of page.data.items) {
      after = event.seq;
      if (event.lease?.id === lease.id || event.process?.id === proc.id) seen.push(event.type);
    }
  }
  assert.deepEqual(seen.slice(0, 2), ["lease.acquired", "lease.released"]);
  assert.deepEqual(seen.slice(-2), ["process.running", "process.stopped"]);
  console.log(`events: ${seen.join(", ")}`);
}

const lease = await leases(`workspace/typescript-${process.pid}`);
const proc = await processes();
await events(lease, proc);
console.log("typescript walkthrough: ok");
