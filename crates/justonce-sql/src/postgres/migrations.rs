//! PostgreSQL's tables, version by version.

use crate::rows::{Migration, Schema};

/// PostgreSQL's migrations, applied in one transaction.
pub(super) const SCHEMA: Schema = Schema {
    script_head: "BEGIN;\n",
    script_tail: "COMMIT;\n",
    setup: MIGRATION_SETUP,
    current_version: "SELECT coalesce(max(version), 0) FROM {prefix}migrations",
    record: "INSERT INTO {prefix}migrations (version, description) VALUES ($1, $2)",
    migrations: MIGRATIONS,
};

const MIGRATION_SETUP: &[&str] = &[
    // Each `IF NOT EXISTS` that finds its object says so in a notice, at every start.
    "SET LOCAL client_min_messages = warning",
    // Serialises migrators of one prefix across processes until the transaction ends.
    "SELECT pg_advisory_xact_lock(hashtext('justonce:{prefix}'))",
    "CREATE TABLE IF NOT EXISTS {prefix}migrations (
        version bigint PRIMARY KEY,
        description text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now()
    )",
];

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "keys, outbox and offsets",
        // "C" collation: keys compare byte for byte, as documented, and index faster.
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}keys (
    scope text COLLATE \"C\" NOT NULL,
    consumer text COLLATE \"C\" NOT NULL,
    key text COLLATE \"C\" NOT NULL,
    fingerprint bytea NOT NULL,
    claim_id bigint NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, consumer, key)
);
CREATE INDEX IF NOT EXISTS {prefix}keys_purge ON {prefix}keys (consumer, processed_at);
CREATE TABLE IF NOT EXISTS {prefix}outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope text NOT NULL,
    key text NOT NULL,
    destination text NOT NULL,
    payload bytea NOT NULL,
    headers text NOT NULL DEFAULT '[]',
    created_at timestamptz NOT NULL DEFAULT now(),
    attempts bigint NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    sent_at timestamptz,
    last_error text,
    lease_token bigint,
    dead boolean NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS {prefix}outbox_due ON {prefix}outbox (next_attempt_at, id)
    WHERE sent_at IS NULL AND NOT dead;
CREATE INDEX IF NOT EXISTS {prefix}outbox_sent ON {prefix}outbox (sent_at)
    WHERE sent_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS {prefix}offsets (
    consumer text COLLATE \"C\" NOT NULL,
    stream text COLLATE \"C\" NOT NULL,
    partition_id integer NOT NULL,
    position bigint NOT NULL,
    sequence bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, stream, partition_id)
);
",
    },
    Migration {
        version: 2,
        description: "leases: fencing token, expiry and result on keys",
        sql: "
ALTER TABLE {prefix}keys
    ADD COLUMN token bigint NOT NULL DEFAULT 0,
    ADD COLUMN lease_until timestamptz,
    ADD COLUMN result bytea;
",
    },
    Migration {
        version: 3,
        description: "breakers: the destinations a relay backed off",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}breakers (
    destination text COLLATE \"C\" PRIMARY KEY,
    failures bigint NOT NULL,
    open_until timestamptz NOT NULL,
    updated_at timestamptz NOT NULL
);
",
    },
    Migration {
        version: 4,
        description: "history: each outbox row's last delivery attempts",
        sql: "
ALTER TABLE {prefix}outbox ADD COLUMN IF NOT EXISTS history jsonb;
",
    },
    Migration {
        version: 5,
        description: "events: when each was received, its replays, and indexes to find them",
        // `created_at` is moved by each replay, to start a new delivery window: the time an
        // event was received needs a column of its own.
        sql: "
ALTER TABLE {prefix}outbox ADD COLUMN IF NOT EXISTS received_at timestamptz;
UPDATE {prefix}outbox SET received_at = created_at WHERE received_at IS NULL;
ALTER TABLE {prefix}outbox
    ALTER COLUMN received_at SET DEFAULT now(),
    ALTER COLUMN received_at SET NOT NULL,
    ADD COLUMN IF NOT EXISTS replay_id bigint;
CREATE INDEX IF NOT EXISTS {prefix}outbox_events ON {prefix}outbox (destination, received_at, id);
CREATE INDEX IF NOT EXISTS {prefix}outbox_key ON {prefix}outbox (key);
CREATE TABLE IF NOT EXISTS {prefix}replays (
    id bigint PRIMARY KEY,
    origin text NOT NULL,
    since_at timestamptz NOT NULL,
    until_at timestamptz NOT NULL,
    started_at timestamptz NOT NULL,
    events bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS {prefix}replays_origin ON {prefix}replays (origin, since_at);
",
    },
    Migration {
        version: 6,
        description: "duplicates: how many each origin answered, minute by minute; events by time received",
        // The index serves the dashboard's minutes.
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}duplicates (
    minute bigint NOT NULL,
    origin text COLLATE \"C\" NOT NULL,
    duplicates bigint NOT NULL,
    PRIMARY KEY (minute, origin)
);
CREATE INDEX IF NOT EXISTS {prefix}outbox_received_at ON {prefix}outbox (received_at);
",
    },
    Migration {
        version: 7,
        description: "keys compared byte for byte in the outbox; the time of each row's last failed delivery",
        // Under the "C" collation, as in the keys table, the key index serves a search by
        // prefix as a range. The dashboard counts failed attempts from the rows that
        // failed within its range only, found by the index on `last_failed_at`; a row's
        // last attempt is no earlier than its last failure.
        sql: "
ALTER TABLE {prefix}outbox ALTER COLUMN key TYPE text COLLATE \"C\";
ALTER TABLE {prefix}outbox ADD COLUMN IF NOT EXISTS last_failed_at timestamptz;
UPDATE {prefix}outbox
    SET last_failed_at = timestamptz 'epoch' + (history->-1->>'at')::bigint * interval '1 millisecond'
    WHERE history IS NOT NULL AND (sent_at IS NULL OR jsonb_array_length(history) > 1)
      AND last_failed_at IS NULL;
CREATE INDEX IF NOT EXISTS {prefix}outbox_failed ON {prefix}outbox (last_failed_at);
",
    },
    Migration {
        version: 8,
        description: "breakers: the lanes a relay backed off, by destination and scope",
        // A breaker is kept per destination and scope. The table holds only what the
        // relays last wrote for `stats`, which each relay writes again when a breaker
        // moves: it is made anew rather than converted.
        sql: "
DROP TABLE IF EXISTS {prefix}breakers;
CREATE TABLE {prefix}breakers (
    destination text COLLATE \"C\" NOT NULL,
    scope text COLLATE \"C\" NOT NULL,
    failures bigint NOT NULL,
    open_until timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (destination, scope)
);
",
    },
    Migration {
        version: 9,
        description: "runs: how many runs of a key a consumer started, for deliveries that may be re-runs",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}runs (
    scope text COLLATE \"C\" NOT NULL,
    consumer text COLLATE \"C\" NOT NULL,
    key text COLLATE \"C\" NOT NULL,
    runs bigint NOT NULL,
    last_run_at timestamptz NOT NULL,
    PRIMARY KEY (scope, consumer, key)
);
CREATE INDEX IF NOT EXISTS {prefix}runs_purge ON {prefix}runs (consumer, last_run_at);
",
    },
];
