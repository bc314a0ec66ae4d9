//! SQLite's tables, version by version.

use crate::rows::{Migration, Schema};

/// SQLite's migrations, applied in one transaction.
pub(super) const SCHEMA: Schema = Schema {
    script_head: "BEGIN IMMEDIATE;\n",
    script_tail: "COMMIT;\n",
    setup: MIGRATION_SETUP,
    current_version: "SELECT coalesce(max(version), 0) FROM {prefix}migrations",
    record: "INSERT INTO {prefix}migrations (version, description) VALUES ($1, $2)",
    migrations: MIGRATIONS,
};

// BEGIN IMMEDIATE already holds the database's only write lock.
const MIGRATION_SETUP: &[&str] = &["CREATE TABLE IF NOT EXISTS {prefix}migrations (
    version INTEGER PRIMARY KEY,
    description TEXT NOT NULL,
    applied_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
)"];

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "keys, outbox and offsets",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}keys (
    scope TEXT NOT NULL,
    consumer TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint BLOB NOT NULL,
    claim_id INTEGER NOT NULL,
    processed_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    PRIMARY KEY (scope, consumer, key)
);
CREATE INDEX IF NOT EXISTS {prefix}keys_purge ON {prefix}keys (consumer, processed_at);
CREATE TABLE IF NOT EXISTS {prefix}outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    destination TEXT NOT NULL,
    payload BLOB NOT NULL,
    headers TEXT NOT NULL DEFAULT '[]',
    created_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    sent_at INTEGER,
    last_error TEXT,
    lease_token INTEGER,
    dead BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE INDEX IF NOT EXISTS {prefix}outbox_due ON {prefix}outbox (next_attempt_at, id)
    WHERE sent_at IS NULL AND NOT dead;
CREATE INDEX IF NOT EXISTS {prefix}outbox_sent ON {prefix}outbox (sent_at)
    WHERE sent_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS {prefix}offsets (
    consumer TEXT NOT NULL,
    stream TEXT NOT NULL,
    partition_id INTEGER NOT NULL,
    position INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, stream, partition_id)
);
",
    },
    Migration {
        version: 2,
        description: "leases: fencing token, expiry and result on keys",
        sql: "
ALTER TABLE {prefix}keys ADD COLUMN token INTEGER NOT NULL DEFAULT 0;
ALTER TABLE {prefix}keys ADD COLUMN lease_until INTEGER;
ALTER TABLE {prefix}keys ADD COLUMN result BLOB;
",
    },
    Migration {
        version: 3,
        description: "breakers: the destinations a relay backed off",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}breakers (
    destination TEXT PRIMARY KEY,
    failures INTEGER NOT NULL,
    open_until INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
",
    },
    Migration {
        version: 4,
        description: "history: each outbox row's last delivery attempts",
        sql: "
ALTER TABLE {prefix}outbox ADD COLUMN history TEXT;
",
    },
    Migration {
        version: 5,
        description: "events: when each was received, its replays, and indexes to find them",
        // `created_at` is moved by each replay, to start a new delivery window: the time an
        // event was received needs a column of its own. SQLite adds a column only with a
        // constant default: the statement that writes a row sets it.
        sql: "
ALTER TABLE {prefix}outbox ADD COLUMN received_at INTEGER NOT NULL DEFAULT 0;
UPDATE {prefix}outbox SET received_at = created_at;
ALTER TABLE {prefix}outbox ADD COLUMN replay_id INTEGER;
CREATE INDEX IF NOT EXISTS {prefix}outbox_events ON {prefix}outbox (destination, received_at, id);
CREATE INDEX IF NOT EXISTS {prefix}outbox_key ON {prefix}outbox (key);
CREATE TABLE IF NOT EXISTS {prefix}replays (
    id INTEGER PRIMARY KEY,
    origin TEXT NOT NULL,
    since_at INTEGER NOT NULL,
    until_at INTEGER NOT NULL,
    started_at INTEGER NOT NULL,
    events INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS {prefix}replays_origin ON {prefix}replays (origin, since_at);
",
    },
    Migration {
        version: 6,
        description: "duplicates: how many each origin answered, minute by minute; events by time received",
        // The trigger sets `received_at` on the rows a process of a version before 5
        // writes without it, which would otherwise be received at 1970 and missed by
        // every search and replay by time. The index serves the dashboard's minutes.
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}duplicates (
    minute INTEGER NOT NULL,
    origin TEXT NOT NULL,
    duplicates INTEGER NOT NULL,
    PRIMARY KEY (minute, origin)
);
UPDATE {prefix}outbox SET received_at = created_at WHERE received_at = 0;
CREATE TRIGGER IF NOT EXISTS {prefix}outbox_received AFTER INSERT ON {prefix}outbox
    WHEN NEW.received_at = 0
BEGIN
    UPDATE {prefix}outbox SET received_at = NEW.created_at WHERE id = NEW.id;
END;
CREATE INDEX IF NOT EXISTS {prefix}outbox_received_at ON {prefix}outbox (received_at);
",
    },
    Migration {
        version: 7,
        description: "the time of each row's last failed delivery",
        // The dashboard counts failed attempts from the rows that failed within its range
        // only, found by the index; a row's last attempt is no earlier than its last failure.
        sql: "
ALTER TABLE {prefix}outbox ADD COLUMN last_failed_at INTEGER;
UPDATE {prefix}outbox SET last_failed_at = json_extract(history, '$[#-1].at')
    WHERE history IS NOT NULL AND (sent_at IS NULL OR json_array_length(history) > 1);
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
    destination TEXT NOT NULL,
    scope TEXT NOT NULL,
    failures INTEGER NOT NULL,
    open_until INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (destination, scope)
);
",
    },
    Migration {
        version: 9,
        description: "runs: how many runs of a key a consumer started, for deliveries that may be re-runs",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}runs (
    scope TEXT NOT NULL,
    consumer TEXT NOT NULL,
    key TEXT NOT NULL,
    runs INTEGER NOT NULL,
    last_run_at INTEGER NOT NULL,
    PRIMARY KEY (scope, consumer, key)
);
CREATE INDEX IF NOT EXISTS {prefix}runs_purge ON {prefix}runs (consumer, last_run_at);
",
    },
];
