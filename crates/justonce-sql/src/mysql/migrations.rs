//! MariaDB's and MySQL's tables, version by version.

use crate::rows::{Migration, Schema};

/// MariaDB's and MySQL's migrations. Their DDL commits at once, so there is no transaction
/// around them: a named lock keeps migrators apart instead.
pub(super) const SCHEMA: Schema = Schema {
    script_head: "-- MariaDB and MySQL commit each CREATE TABLE at once: apply this script whole.\n",
    script_tail: "",
    setup: &[MIGRATION_TABLE],
    current_version: "SELECT CAST(coalesce(max(version), 0) AS SIGNED) FROM {prefix}migrations",
    record: "INSERT INTO {prefix}migrations (version, description) VALUES (?, ?)",
    migrations: MIGRATIONS,
};

/// How long a migrator waits for another one to finish, in seconds.
pub(super) const MIGRATION_LOCK_SECONDS: u32 = 60;

const MIGRATION_TABLE: &str = "CREATE TABLE IF NOT EXISTS {prefix}migrations (
    version BIGINT NOT NULL PRIMARY KEY,
    description TEXT NOT NULL,
    applied_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6))
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4";

// Keys, scopes, consumers and streams are VARBINARY: they compare byte for byte, as
// documented, and without the trailing-space padding of MariaDB's `_bin` collations, under
// which `a` and `a ` would be one key. Every time is set by the statements from the store's
// clock, in UTC, never by a column default in the session's time zone.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "keys, outbox and offsets",
        // The lease columns of version 2 come with the table: MySQL's DDL commits at once,
        // and has no `ADD COLUMN IF NOT EXISTS` with which to repeat a half-applied step.
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}keys (
    scope VARBINARY(128) NOT NULL,
    consumer VARBINARY(128) NOT NULL,
    `key` VARBINARY(255) NOT NULL,
    fingerprint BINARY(32) NOT NULL,
    claim_id BIGINT NOT NULL,
    processed_at DATETIME(6) NOT NULL,
    token BIGINT NOT NULL DEFAULT 0,
    lease_until DATETIME(6) NULL,
    result LONGBLOB NULL,
    PRIMARY KEY (scope, consumer, `key`),
    KEY keys_purge (consumer, processed_at)
) ENGINE=InnoDB;
CREATE TABLE IF NOT EXISTS {prefix}outbox (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    scope TEXT NOT NULL,
    `key` TEXT NOT NULL,
    destination TEXT NOT NULL,
    payload LONGBLOB NOT NULL,
    headers MEDIUMTEXT NOT NULL,
    created_at DATETIME(6) NOT NULL,
    attempts BIGINT NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6) NOT NULL,
    sent_at DATETIME(6) NULL,
    last_error TEXT NULL,
    lease_token BIGINT NULL,
    dead BOOLEAN NOT NULL DEFAULT FALSE,
    KEY outbox_due (dead, sent_at, next_attempt_at, id),
    KEY outbox_sent (sent_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
CREATE TABLE IF NOT EXISTS {prefix}offsets (
    consumer VARBINARY(128) NOT NULL,
    stream VARBINARY(1024) NOT NULL,
    partition_id INT NOT NULL,
    position BIGINT NOT NULL,
    sequence BIGINT NOT NULL,
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (consumer, stream, partition_id)
) ENGINE=InnoDB;
",
    },
    Migration {
        version: 2,
        description: "leases: fencing token, expiry and result on keys",
        sql: "",
    },
    Migration {
        version: 3,
        description: "breakers: the destinations a relay backed off",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}breakers (
    destination VARCHAR(255) NOT NULL PRIMARY KEY,
    failures BIGINT NOT NULL,
    open_until DATETIME(6) NOT NULL,
    updated_at DATETIME(6) NOT NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
",
    },
    Migration {
        version: 4,
        description: "history: each outbox row's last delivery attempts",
        // MySQL has no `ADD COLUMN IF NOT EXISTS` and commits DDL at once: a migrator that
        // died after the ALTER and before recording the version must find nothing to do.
        sql: "
SET @justonce_add_history = IF(
    (SELECT count(*) FROM information_schema.columns
     WHERE table_schema = DATABASE() AND table_name = '{prefix}outbox'
       AND column_name = 'history') = 0,
    'ALTER TABLE {prefix}outbox ADD COLUMN history LONGTEXT NULL',
    'DO 0');
PREPARE justonce_add_history FROM @justonce_add_history;
EXECUTE justonce_add_history;
DEALLOCATE PREPARE justonce_add_history;
",
    },
    Migration {
        version: 5,
        description: "events: when each was received, its replays, and indexes to find them",
        // `created_at` is moved by each replay, to start a new delivery window: the time an
        // event was received needs a column of its own. The columns and indexes come in one
        // ALTER, which is whole or not at all, and which a repeated migration skips. The
        // default serves a process of the version before, still running, that inserts rows
        // without the column; the rows before the migration take their `created_at`.
        sql: "
SET @justonce_add_events = IF(
    (SELECT count(*) FROM information_schema.columns
     WHERE table_schema = DATABASE() AND table_name = '{prefix}outbox'
       AND column_name = 'received_at') = 0,
    'ALTER TABLE {prefix}outbox ADD COLUMN received_at DATETIME(6) NULL,
        ADD COLUMN replay_id BIGINT NULL,
        ADD KEY outbox_events (destination(191), received_at, id),
        ADD KEY outbox_key (`key`(191))',
    'DO 0');
PREPARE justonce_add_events FROM @justonce_add_events;
EXECUTE justonce_add_events;
DEALLOCATE PREPARE justonce_add_events;
ALTER TABLE {prefix}outbox ALTER COLUMN received_at SET DEFAULT CURRENT_TIMESTAMP(6);
UPDATE {prefix}outbox SET received_at = created_at WHERE received_at IS NULL;
CREATE TABLE IF NOT EXISTS {prefix}replays (
    id BIGINT NOT NULL PRIMARY KEY,
    origin VARCHAR(255) NOT NULL,
    since_at DATETIME(6) NOT NULL,
    until_at DATETIME(6) NOT NULL,
    started_at DATETIME(6) NOT NULL,
    events BIGINT NOT NULL,
    KEY replays_origin (origin, since_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
",
    },
    Migration {
        version: 6,
        description: "duplicates: how many each origin answered, minute by minute; events by time received",
        // The index serves the dashboard's minutes.
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}duplicates (
    minute BIGINT NOT NULL,
    origin VARCHAR(255) NOT NULL,
    duplicates BIGINT NOT NULL,
    PRIMARY KEY (minute, origin)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
CREATE INDEX IF NOT EXISTS outbox_received_at ON {prefix}outbox (received_at);
",
    },
    Migration {
        version: 7,
        description: "the time of each row's last failed delivery; column defaults in UTC",
        // The dashboard counts failed attempts from the rows that failed within its range
        // only, found by the index; a row's last attempt is no earlier than its last
        // failure. `CURRENT_TIMESTAMP` is in the session's time zone, which a URL's
        // `timezone` sets: the defaults (for a process of a version before 5, and the
        // migrations' own times) take UTC, as every statement does.
        sql: "
SET @justonce_add_failed = IF(
    (SELECT count(*) FROM information_schema.columns
     WHERE table_schema = DATABASE() AND table_name = '{prefix}outbox'
       AND column_name = 'last_failed_at') = 0,
    'ALTER TABLE {prefix}outbox ADD COLUMN last_failed_at DATETIME(6) NULL,
        ADD KEY outbox_failed (last_failed_at)',
    'DO 0');
PREPARE justonce_add_failed FROM @justonce_add_failed;
EXECUTE justonce_add_failed;
DEALLOCATE PREPARE justonce_add_failed;
UPDATE {prefix}outbox
    SET last_failed_at = TIMESTAMPADD(MICROSECOND,
        CAST(JSON_EXTRACT(history, CONCAT('$[', JSON_LENGTH(history) - 1, '].at')) AS SIGNED) * 1000,
        TIMESTAMP '1970-01-01 00:00:00')
    WHERE history IS NOT NULL AND (sent_at IS NULL OR JSON_LENGTH(history) > 1)
      AND last_failed_at IS NULL;
ALTER TABLE {prefix}outbox ALTER COLUMN received_at SET DEFAULT (UTC_TIMESTAMP(6));
ALTER TABLE {prefix}migrations ALTER COLUMN applied_at SET DEFAULT (UTC_TIMESTAMP(6));
",
    },
    Migration {
        version: 8,
        description: "breakers: the lanes a relay backed off, by destination and scope",
        // A breaker is kept per destination and scope. The table holds only what the
        // relays last wrote for `stats`, which each relay writes again when a breaker
        // moves: it is made anew rather than converted.
        // A scope is at most 128 bytes: the key stays within InnoDB's 3072.
        sql: "
DROP TABLE IF EXISTS {prefix}breakers;
CREATE TABLE {prefix}breakers (
    destination VARCHAR(255) NOT NULL,
    scope VARCHAR(128) NOT NULL,
    failures BIGINT NOT NULL,
    open_until DATETIME(6) NOT NULL,
    updated_at DATETIME(6) NOT NULL,
    PRIMARY KEY (destination, scope)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
",
    },
    Migration {
        version: 9,
        description: "runs: how many runs of a key a consumer started, for deliveries that may be re-runs",
        sql: "
CREATE TABLE IF NOT EXISTS {prefix}runs (
    scope VARBINARY(128) NOT NULL,
    consumer VARBINARY(128) NOT NULL,
    `key` VARBINARY(255) NOT NULL,
    runs BIGINT NOT NULL,
    last_run_at DATETIME(6) NOT NULL,
    PRIMARY KEY (scope, consumer, `key`),
    KEY runs_purge (consumer, last_run_at)
) ENGINE=InnoDB;
",
    },
];
