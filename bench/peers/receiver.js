// The webhook receiver the bench holds `justonce serve` against: written the plain way,
// with node's http module and node-postgres.
//
// Per POST /webhooks/<source> with a JSON body holding a unique "id": BEGIN, the claim
// (INSERT the key ON CONFLICT DO NOTHING), the outbox row with the body when the key was
// new, COMMIT: four round trips on a connection from a pool. No signature (as a source with
// scheme none) and no delivery (as `justonce serve` with only the receiver role).
//
// Listens on PEER_LISTEN (host:port); PEER_DATABASE is the database, PEER_POOL_SIZE the
// pool's connections. Prints "listening on host:port" once it accepts.

"use strict";

const http = require("node:http");
const { Pool } = require("pg");

const KEYS = "peer_receiver_keys";
const OUTBOX = "peer_receiver_outbox";
const BODY_LIMIT = 1 << 20;

const pool = new Pool({
  connectionString: process.env.PEER_DATABASE,
  max: Number(process.env.PEER_POOL_SIZE || 10),
});

async function receive(source, body, contentType) {
  let id;
  try {
    id = JSON.parse(body.toString("utf8")).id;
  } catch {
    return [400, { status: "invalid", detail: "the body is not JSON" }];
  }
  if (typeof id !== "string" || id === "") {
    return [400, { status: "invalid", detail: "the body has no id" }];
  }
  const key = `${source}:${id}`;
  const client = await pool.connect();
  try {
    await client.query("BEGIN");
    const claimed = await client.query(
      `INSERT INTO ${KEYS} (key) VALUES ($1) ON CONFLICT DO NOTHING`,
      [key],
    );
    if (claimed.rowCount === 1) {
      await client.query(
        `INSERT INTO ${OUTBOX} (key, payload, headers) VALUES ($1, $2, $3)`,
        [key, body, JSON.stringify([["content-type", contentType || ""]])],
      );
    }
    await client.query("COMMIT");
    return [200, { status: claimed.rowCount === 1 ? "accepted" : "duplicate", key }];
  } catch (error) {
    await client.query("ROLLBACK").catch(() => {});
    throw error;
  } finally {
    client.release();
  }
}

function answer(response, status, json) {
  const text = JSON.stringify(json);
  response.writeHead(status, {
    "content-type": "application/json",
    "content-length": Buffer.byteLength(text),
  });
  response.end(text);
}

const server = http.createServer((request, response) => {
  const match = /^\/webhooks\/([^/?]+)$/.exec(request.url);
  if (request.method !== "POST" || !match) {
    answer(response, 404, { status: "not found" });
    return;
  }
  const chunks = [];
  let size = 0;
  request.on("data", (chunk) => {
    size += chunk.length;
    if (size > BODY_LIMIT) {
      answer(response, 413, { status: "too large" });
      request.destroy();
    } else {
      chunks.push(chunk);
    }
  });
  request.on("end", () => {
    receive(match[1], Buffer.concat(chunks), request.headers["content-type"]).then(
      ([status, json]) => answer(response, status, json),
      (error) => answer(response, 503, { status: "unavailable", detail: String(error) }),
    );
  });
});

async function main() {
  await pool.query(
    `CREATE TABLE IF NOT EXISTS ${KEYS} (
       key text PRIMARY KEY,
       received_at timestamptz NOT NULL DEFAULT now())`,
  );
  await pool.query(
    `CREATE TABLE IF NOT EXISTS ${OUTBOX} (
       id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
       key text NOT NULL,
       payload bytea NOT NULL,
       headers text NOT NULL,
       created_at timestamptz NOT NULL DEFAULT now(),
       sent_at timestamptz)`,
  );
  // What a relay would read the rows to deliver by.
  await pool.query(
    `CREATE INDEX IF NOT EXISTS ${OUTBOX}_pending ON ${OUTBOX} (id) WHERE sent_at IS NULL`,
  );
  const [host, port] = (process.env.PEER_LISTEN || "127.0.0.1:0").split(/:(?=\d+$)/);
  server.listen(Number(port), host, () => {
    const address = server.address();
    console.log(`listening on ${address.address}:${address.port}`);
  });
}

for (const signal of ["SIGINT", "SIGTERM"]) {
  process.on(signal, () => server.close(() => pool.end().then(() => process.exit(0))));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
