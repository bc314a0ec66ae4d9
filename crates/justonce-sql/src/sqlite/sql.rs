//! SQLite's statements: those written for it alone, and its clock for those it writes as
//! PostgreSQL does.

use crate::numbered::{Clock, Specific, Statements};
use crate::rows::HISTORY_LENGTH;
use crate::tables::Tables;

/// The store's clock, in milliseconds since the Unix epoch.
const NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

const CLOCK: Clock = Clock {
    now: NOW_MS,
    later_by: |millis| format!("({NOW_MS} + {millis})"),
    earlier_by: |millis| format!("({NOW_MS} - {millis})"),
    age_ms: |column| format!("({NOW_MS} - {column})"),
    // Times are stored in whole milliseconds.
    micros_of: |column| format!("({column} * 1000)"),
    at_micros: |micros| format!("({micros} / 1000)"),
};

/// The statements of the tables under one prefix.
pub(super) fn statements(tables: &Tables) -> Statements {
    let Tables { keys, outbox, .. } = tables;
    let specific = Specific {
        claim: format!(
            "INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id, processed_at)
             VALUES ($1, $2, $3, $4, $5, {NOW_MS})
             ON CONFLICT (scope, consumer, key) DO NOTHING
             RETURNING claim_id, fingerprint"
        ),
        // One JSON array of [key, hex fingerprint] pairs keeps the statement text fixed
        // whatever the batch size, so it is prepared once.
        insert_many: format!(
            "INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id, processed_at)
             SELECT $1, $2, value ->> 0, unhex(value ->> 1), $3, {NOW_MS}
             FROM json_each($4) WHERE true
             ON CONFLICT (scope, consumer, key) DO NOTHING
             RETURNING key"
        ),
        keys_given: |alias| format!("(SELECT value AS key FROM json_each($3)) AS {alias}"),
        find_many: format!(
            "SELECT key, claim_id, fingerprint FROM {keys}
             WHERE scope = $1 AND consumer = $2
               AND key IN (SELECT value FROM json_each($3))"
        ),
        has_unique_constraint: format!(
            "SELECT count(*) FROM pragma_index_list('{keys}') AS list
             WHERE list.\"unique\" = 1 AND list.partial = 0
               AND (SELECT group_concat(name, ',') FROM (
                      SELECT name FROM pragma_index_info(list.name) ORDER BY name
                   )) = 'consumer,key,scope'"
        ),
        purge_keys: format!(
            "DELETE FROM {keys} WHERE rowid IN (
                SELECT rowid FROM {keys}
                WHERE consumer = $1 AND processed_at < {NOW_MS} - $2
                LIMIT $3
             )"
        ),
        enqueue: format!(
            "INSERT INTO {outbox} (scope, key, destination, payload, headers, received_at)
             VALUES ($1, $2, $3, $4, $5, {NOW_MS})
             RETURNING id"
        ),
        // One row per statement: each costs a call into this process's SQLite, not a
        // round trip.
        forward_many: format!(
            "INSERT INTO {outbox} (scope, key, destination, payload, headers, received_at)
             VALUES ($1, $2, $3, $4, $5, {NOW_MS})"
        ),
        // No relay listens: they poll, and this process's are woken after the commit.
        enqueue_notifying: None,
        // A WITH clause cannot insert on SQLite.
        claim_and_forward: None,
        claim_and_forward_many: None,
        insert_many_at_offsets: None,
        // The single writer already keeps two relays from taking one row.
        skip_locked: "",
        held_back: |array| {
            format!(
                "SELECT 1 FROM json_each({array}) AS held
                 WHERE held.value ->> 0 = destination
                   AND coalesce(held.value ->> 1, scope) = scope"
            )
        },
        // The oldest attempt is dropped once the history is full.
        append_attempt: |duration, status, answer, error| {
            format!(
                "history = json_insert(
                    CASE WHEN json_array_length(coalesce(history, '[]')) >= {HISTORY_LENGTH}
                         THEN json_remove(history, '$[0]') ELSE coalesce(history, '[]') END,
                    '$[#]',
                    json_object('attempt', attempts, 'at', {NOW_MS}, 'ms', {duration},
                                'status', {status}, 'answer', {answer}, 'error', {error}))"
            )
        },
        position: "instr",
        history_text: "history",
        // A replay's transaction begins with the database's only write lock.
        replay_lock: None,
    };
    Statements::new(tables, &CLOCK, specific)
}
