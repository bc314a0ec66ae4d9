//! MariaDB's and MySQL's statements, with `?` for their parameters, bound in the order
//! they appear.

use crate::common::{Common, EVENT_STATE, REPLAYED, dashboard_minutes, failed_histories};
use crate::rows::HISTORY_LENGTH;
use crate::tables::Tables;
use std::sync::Arc;

/// The store's clock. UTC whatever the session's time zone, since DATETIME holds none.
const NOW: &str = "UTC_TIMESTAMP(6)";

/// `NOW` moved forward by the milliseconds of the next parameter.
const LATER: &str = "(UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND)";

/// `NOW` moved back by the milliseconds of the next parameter.
const EARLIER: &str = "(UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND)";

/// Milliseconds from a time column to now.
fn age_ms(column: &str) -> String {
    format!("CAST(TIMESTAMPDIFF(MICROSECOND, {column}, {NOW}) DIV 1000 AS SIGNED)")
}

/// A time column as microseconds since the Unix epoch. Times are stored in UTC.
fn micros_of(column: &str) -> String {
    format!("CAST(TIMESTAMPDIFF(MICROSECOND, TIMESTAMP '1970-01-01 00:00:00', {column}) AS SIGNED)")
}

/// The time of the next parameter's microseconds since the Unix epoch.
const AT_MICROS: &str = "TIMESTAMPADD(MICROSECOND, ?, TIMESTAMP '1970-01-01 00:00:00')";

/// The assignment that appends one attempt to a row's history, its duration, status,
/// answer and error the next parameters (or `NULL` for no error). The oldest attempt is
/// dropped once the history is full.
fn append_attempt(error: &str) -> String {
    format!(
        "history = JSON_ARRAY_APPEND(
            CASE WHEN JSON_LENGTH(coalesce(history, '[]')) >= {HISTORY_LENGTH}
                 THEN JSON_REMOVE(history, '$[0]') ELSE coalesce(history, '[]') END,
            '$',
            JSON_OBJECT('attempt', attempts,
                        'at', CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', {NOW}) DIV 1000 AS SIGNED),
                        'ms', ?, 'status', ?, 'answer', ?, 'error', {error}))"
    )
}

/// The statements of one table prefix on MariaDB or MySQL, built once. Those that take a
/// list have `{list}` where its placeholders go.
#[derive(Debug)]
pub struct MySqlStatements {
    pub(crate) common: Common,
    pub(crate) claim: Arc<str>,
    pub(crate) insert_many: Arc<str>,
    pub(crate) find_many: Arc<str>,
    pub(crate) enqueue: Arc<str>,
    pub(crate) forward_many: Arc<str>,
    pub(crate) due_ids: Arc<str>,
    pub(crate) take_ids: Arc<str>,
    pub(crate) rows_by_id: Arc<str>,
    pub(crate) outbox_row: Arc<str>,
    pub(crate) dead_letters: Arc<str>,
    pub(crate) ensure_offset: Arc<str>,
    pub(crate) move_offset: Arc<str>,
    pub(crate) ensure_lease: Arc<str>,
    pub(crate) lease_take_over: Arc<str>,
    pub(crate) lease_token: Arc<str>,
    /// scope, consumer, key: the statement's `LAST_INSERT_ID` is the runs started, this
    /// one included; 0 when it inserted the row (a first run).
    pub(crate) record_run: Arc<str>,
    /// scope, consumer, `{rows}` of one key each, scope, consumer, `{list}` of the same
    /// keys: counts a first run of each unless one of them has runs counted.
    pub(crate) record_first_runs: Arc<str>,
}

impl AsRef<Common> for MySqlStatements {
    fn as_ref(&self) -> &Common {
        &self.common
    }
}

impl MySqlStatements {
    pub(super) fn new(tables: &Tables) -> Self {
        let Tables {
            keys,
            outbox,
            offsets,
            breakers,
            replays,
            duplicates,
            migrations,
            runs,
            ..
        } = tables;
        // What a stored event is, read from its outbox row.
        let event_columns = format!(
            "id, scope, `key`, destination, {} AS received_us, {EVENT_STATE} AS state, \
             attempts, last_error",
            micros_of("received_at")
        );
        let event_detail =
            format!("SELECT {event_columns}, payload, headers, history FROM {outbox}");
        // A listing of stored events, its key prefix's condition given.
        let events_where = |key_prefix: &str| {
            format!(
                "SELECT {event_columns} FROM {outbox}
                 WHERE (? IS NULL OR destination = ?)
                   AND {key_prefix}
                   AND (? IS NULL OR LOCATE(?, `key`) > 0)
                   AND (? IS NULL OR received_at >= {AT_MICROS})
                   AND (? IS NULL OR received_at <= {AT_MICROS})
                   AND (? IS NULL OR {EVENT_STATE} = ?)
                   AND (? IS NULL OR received_at > {AT_MICROS}
                        OR (received_at = {AT_MICROS} AND id > ?))
                 ORDER BY received_at, id LIMIT ?"
            )
        };
        // A replay still runs while an event it put back waits for its delivery.
        let replay_running = format!(
            "EXISTS (SELECT 1 FROM {outbox} AS o
                     WHERE o.destination = w.origin AND o.received_at >= w.since_at
                       AND o.received_at <= w.until_at AND o.replay_id = w.id
                       AND o.sent_at IS NULL AND NOT o.dead)"
        );
        let replay_columns = format!(
            "w.id, w.origin, {}, {}, {}, w.events, {replay_running}",
            micros_of("w.since_at"),
            micros_of("w.until_at"),
            micros_of("w.started_at")
        );
        let columns = format!(
            "id, scope, `key`, destination, payload, headers, attempts, last_error, dead, \
             sent_at IS NOT NULL AS sent, {} AS age_ms",
            age_ms("created_at")
        );
        let this_key = "scope = ? AND consumer = ? AND `key` = ?";
        let due = "sent_at IS NULL AND dead = FALSE";
        // Sent, due and dead rows, and the age of the oldest due one.
        let outbox_counts = format!(
            "count(CASE WHEN sent_at IS NOT NULL THEN 1 END),
             count(CASE WHEN {due} THEN 1 END),
             count(CASE WHEN dead THEN 1 END),
             CAST(coalesce(max(CASE WHEN {due} THEN {} END), 0) AS SIGNED)",
            age_ms("created_at")
        );
        // Rows of one destination written (or replayed) within a window of time.
        let window = format!(
            "(? IS NULL OR destination = ?)
             AND (? IS NULL OR created_at >= {EARLIER})
             AND (? IS NULL OR created_at <= {EARLIER})"
        );
        // Rows of one state within a window, after an id.
        let list = |state: &str, order: &str| {
            format!(
                "SELECT id, scope, `key`, destination, attempts, last_error, {} AS age_ms,
                        -{} AS next_in_ms
                 FROM {outbox}
                 WHERE {state} AND {window} AND (? IS NULL OR id > ?)
                 ORDER BY {order} LIMIT ?",
                age_ms("created_at"),
                age_ms("next_attempt_at"),
            )
        };
        let arc = |sql: String| Arc::<str>::from(sql);
        let common = Common {
            // A locking read sees the latest committed row, where a plain one would see the
            // transaction's snapshot, which may predate the holder's commit.
            find: arc(format!(
                "SELECT claim_id, fingerprint FROM {keys} WHERE {this_key} LOCK IN SHARE MODE"
            )),
            has_unique_constraint: arc(format!(
                "SELECT count(*) FROM (
                        SELECT index_name FROM information_schema.statistics
                        WHERE table_schema = DATABASE() AND table_name = '{keys}'
                          AND non_unique = 0
                        GROUP BY index_name
                        HAVING group_concat(column_name ORDER BY column_name) = 'consumer,key,scope'
                     ) AS found"
            )),
            purge_keys: arc(format!(
                "DELETE FROM {keys} WHERE consumer = ? AND processed_at < {EARLIER} LIMIT ?"
            )),
            forget_runs: arc(format!(
                "DELETE FROM {runs} WHERE scope = ? AND consumer = ? AND `key` = ?"
            )),
            purge_runs: arc(format!(
                "DELETE FROM {runs} WHERE consumer = ? AND last_run_at < {EARLIER} LIMIT ?"
            )),
            // Each outcome appends its attempt to the history in the same statement, first:
            // MariaDB's assignments see the ones before them. Each is recorded only under
            // the lease token the row was taken with, which a replay takes away.
            mark_sent: arc(format!(
                "UPDATE {outbox} SET {}, sent_at = {NOW}, dead = FALSE, last_error = NULL
                     WHERE id = ? AND lease_token = ?",
                append_attempt("NULL")
            )),
            mark_retry: arc(format!(
                "UPDATE {outbox} SET {}, next_attempt_at = {LATER}, last_error = ?,
                        last_failed_at = {NOW}
                     WHERE id = ? AND lease_token = ? AND {due}",
                append_attempt("?")
            )),
            mark_dead: arc(format!(
                "UPDATE {outbox} SET {}, dead = TRUE, last_error = ?, last_failed_at = {NOW}
                     WHERE id = ? AND lease_token = ? AND {due}",
                append_attempt("?")
            )),
            list_due: arc(list(due, "created_at, id")),
            list_dead: arc(list("dead", "id")),
            history: arc(format!("SELECT history FROM {outbox} WHERE id = ?")),
            dashboard_minutes: arc(dashboard_minutes(outbox, micros_of, AT_MICROS, AT_MICROS)),
            failed_histories: arc(failed_histories(outbox, "history", AT_MICROS)),
            duplicate_minutes: arc(format!(
                "SELECT origin, minute, duplicates FROM {duplicates} WHERE minute >= ?"
            )),
            add_duplicates: arc(format!(
                "INSERT INTO {duplicates} (minute, origin, duplicates) VALUES (?, ?, ?)
                 ON DUPLICATE KEY UPDATE duplicates = duplicates + VALUES(duplicates)"
            )),
            ids_by_key: arc(format!(
                "SELECT id FROM {outbox} WHERE `key` = ? ORDER BY id"
            )),
            untake: arc(format!(
                "UPDATE {outbox} SET next_attempt_at = {LATER}, attempts = attempts - 1
                     WHERE id = ? AND lease_token = ? AND {due}"
            )),
            breaker_open: arc(format!(
                "INSERT INTO {breakers} (destination, scope, failures, open_until, updated_at)
                     VALUES (?, ?, ?, {LATER}, {NOW})
                     ON DUPLICATE KEY UPDATE failures = VALUES(failures),
                        open_until = VALUES(open_until), updated_at = VALUES(updated_at)"
            )),
            breaker_close: arc(format!(
                "DELETE FROM {breakers} WHERE destination = ? AND scope = ?"
            )),
            breakers: arc(format!(
                "SELECT destination, scope, failures, -{}, {} FROM {breakers}
                     ORDER BY destination, scope",
                age_ms("open_until"),
                age_ms("updated_at")
            )),
            // Leased rows too: should one be sent meanwhile, `mark_sent` outranks this.
            expire: arc(format!(
                "UPDATE {outbox} SET dead = TRUE, last_error = ?
                     WHERE {due} AND destination = ? AND scope = ? AND created_at <= {EARLIER}
                     ORDER BY id LIMIT ?"
            )),
            replay: arc(format!(
                "UPDATE {outbox}
                     SET {REPLAYED}, next_attempt_at = {NOW}, created_at = {NOW}
                     WHERE dead AND sent_at IS NULL AND (? IS NULL OR id = ?) AND {window}
                     ORDER BY id LIMIT ?"
            )),
            // `LOCATE` makes the range exact: `_bin` collations compare `a` and `a ` alike.
            events: arc(events_where(
                "(? IS NULL OR (`key` >= ? AND (? IS NULL OR `key` < ?) AND LOCATE(?, `key`) = 1))",
            )),
            events_in_key_range: arc(events_where(
                "? IS NOT NULL AND `key` >= ? AND ? IS NOT NULL AND `key` < ?
                   AND LOCATE(?, `key`) = 1",
            )),
            event_by_id: arc(format!("{event_detail} WHERE id = ?")),
            events_by_key: arc(format!("{event_detail} WHERE `key` = ? ORDER BY id")),
            replayable: arc(format!(
                "SELECT count(*) FROM {outbox}
                 WHERE destination = ? AND received_at >= {AT_MICROS}
                   AND received_at <= coalesce({AT_MICROS}, {NOW})
                   AND (sent_at IS NOT NULL OR dead)"
            )),
            // The row of the migration that made the replays table: one row that every
            // replay locks until its transaction ends, so that replays run one at a time.
            replay_lock: Some(arc(format!(
                "SELECT version FROM {migrations} WHERE version = 5 FOR UPDATE"
            ))),
            running_replay: arc(format!(
                "SELECT w.id FROM {replays} AS w
                 WHERE w.origin = ? AND w.since_at <= coalesce({AT_MICROS}, {NOW})
                   AND w.until_at >= {AT_MICROS} AND {replay_running}
                 ORDER BY w.id LIMIT 1"
            )),
            insert_replay: arc(format!(
                "INSERT INTO {replays} (id, origin, since_at, until_at, started_at, events)
                 VALUES (?, ?, {AT_MICROS}, coalesce({AT_MICROS}, {NOW}), {NOW}, 0)"
            )),
            replay_window: arc(format!(
                "UPDATE {outbox} SET {REPLAYED}, created_at = {NOW}, next_attempt_at = {NOW},
                    replay_id = ?
                 WHERE destination = ? AND received_at >= {AT_MICROS}
                   AND received_at <= (SELECT until_at FROM {replays} WHERE id = ?)
                   AND (sent_at IS NOT NULL OR dead)"
            )),
            count_replay: arc(format!("UPDATE {replays} SET events = ? WHERE id = ?")),
            replay_by_id: arc(format!(
                "SELECT {replay_columns} FROM {replays} AS w WHERE w.id = ?"
            )),
            replays: arc(format!(
                "SELECT {replay_columns} FROM {replays} AS w
                 ORDER BY w.started_at DESC, w.id DESC LIMIT ?"
            )),
            replay_event: arc(format!(
                "UPDATE {outbox} SET {REPLAYED}, created_at = {NOW}, next_attempt_at = {NOW},
                    replay_id = NULL
                 WHERE id = ? AND (sent_at IS NOT NULL OR dead)"
            )),
            replay_key: arc(format!(
                "UPDATE {outbox} SET {REPLAYED}, created_at = {NOW}, next_attempt_at = {NOW},
                    replay_id = NULL
                 WHERE `key` = ? AND (sent_at IS NOT NULL OR dead)"
            )),
            purge_events: arc(format!(
                "DELETE FROM {outbox}
                 WHERE destination = ? AND sent_at IS NOT NULL AND received_at < {EARLIER}
                 LIMIT ?"
            )),
            purge_dead: arc(format!("DELETE FROM {outbox} WHERE dead AND {window}")),
            purge_duplicates: arc(format!("DELETE FROM {duplicates} WHERE minute < ? LIMIT ?")),
            purge_sent: arc(format!(
                "DELETE FROM {outbox} WHERE sent_at < {EARLIER} LIMIT ?"
            )),
            load_offsets: arc(format!(
                "SELECT partition_id, position, sequence FROM {offsets}
                     WHERE consumer = ? AND stream = ? ORDER BY partition_id"
            )),
            all_offsets: arc(format!(
                "SELECT {}, {}, partition_id, position, sequence FROM {offsets}
                     ORDER BY consumer, stream, partition_id",
                text("consumer"),
                text("stream")
            )),
            outbox_stats: arc(format!("SELECT {outbox_counts} FROM {outbox}")),
            destination_stats: arc(format!(
                "SELECT destination, {outbox_counts} FROM {outbox}
                 GROUP BY destination ORDER BY destination"
            )),
            lease_state: arc(format!(
                "SELECT fingerprint, lease_until IS NULL AS done, result,
                            CASE WHEN lease_until IS NULL THEN 0 ELSE -{} END AS remaining_ms
                     FROM {keys} WHERE {this_key}",
                age_ms("lease_until")
            )),
            // Each change to a lease names its token: a holder whose lease was taken over
            // changes nothing.
            lease_complete: arc(format!(
                "UPDATE {keys} SET lease_until = NULL, result = ?, processed_at = {NOW}
                     WHERE {this_key} AND token = ? AND lease_until IS NOT NULL"
            )),
            lease_release: arc(format!(
                "UPDATE {keys} SET lease_until = {NOW}
                     WHERE {this_key} AND token = ? AND lease_until IS NOT NULL"
            )),
            lease_renew: arc(format!(
                "UPDATE {keys} SET lease_until = {LATER}
                     WHERE {this_key} AND token = ? AND lease_until IS NOT NULL"
            )),
            // An operator's release is the lease running out now: the holder keeps its
            // token until the next claim takes the key over with a larger one.
            force_release: arc(format!(
                "UPDATE {keys} SET lease_until = {NOW}
                     WHERE {this_key} AND lease_until IS NOT NULL"
            )),
            // An operator's completion takes the key from its holder: the new token refuses
            // the holder's late complete, renew or release.
            force_complete: arc(format!(
                "UPDATE {keys}
                     SET lease_until = NULL, result = ?, token = token + 1, processed_at = {NOW}
                     WHERE {this_key} AND lease_until IS NOT NULL"
            )),
            store_result: arc(format!("UPDATE {keys} SET result = ? WHERE {this_key}")),
            oldest_key_age: arc(format!(
                "SELECT CAST(coalesce({}, 0) AS SIGNED) FROM {keys} WHERE consumer = ?",
                age_ms("min(processed_at)")
            )),
            key_counts: arc(format!(
                "SELECT {}, {}, count(*), count(lease_until) FROM {keys}
                     GROUP BY consumer, scope ORDER BY consumer, scope",
                text("consumer"),
                text("scope")
            )),
        };
        Self {
            common,
            claim: arc(format!(
                "INSERT INTO {keys} (scope, consumer, `key`, fingerprint, claim_id, processed_at)
                 VALUES (?, ?, ?, ?, ?, {NOW})"
            )),
            // The no-op update locks a present key as the insert locks a new one, in key
            // order; which keys were new is read back by the batch's claim id.
            insert_many: arc(format!(
                "INSERT INTO {keys} (scope, consumer, `key`, fingerprint, claim_id, processed_at)
                 VALUES {{list}}
                 ON DUPLICATE KEY UPDATE claim_id = claim_id"
            )),
            // One lookup of each key, joined in this order: a locking read of
            // `key IN (...)` scans a range and locks the gaps between the keys too, so that
            // a concurrent batch whose keys fall between them waits for this one's commit.
            find_many: arc(format!(
                "SELECT {}, held.claim_id, held.fingerprint
                 FROM ({{list}}) AS batch
                 STRAIGHT_JOIN {keys} AS held ON held.`key` = batch.`key`
                 WHERE held.scope = ? AND held.consumer = ?
                 LOCK IN SHARE MODE",
                text("held.`key`")
            )),
            enqueue: arc(format!(
                "INSERT INTO {outbox}
                    (scope, `key`, destination, payload, headers, created_at, next_attempt_at,
                     received_at)
                 VALUES (?, ?, ?, ?, ?, {NOW}, {NOW}, {NOW})"
            )),
            forward_many: arc(format!(
                "INSERT INTO {outbox}
                    (scope, `key`, destination, payload, headers, created_at, next_attempt_at,
                     received_at)
                 VALUES {{list}}"
            )),
            // Taking due rows is three statements in one short transaction: MariaDB's UPDATE
            // returns no rows. No lock is held while the rows are sent. The lanes held back
            // are compared byte for byte, as the outbox's columns are.
            due_ids: arc(format!(
                "SELECT id FROM {outbox}
                 WHERE {due} AND next_attempt_at <= {NOW}
                   AND NOT EXISTS (
                      SELECT 1 FROM JSON_TABLE(?, '$[*]' COLUMNS (
                         d TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin PATH '$[0]',
                         s TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin PATH '$[1]')) AS held
                      WHERE held.d = destination AND coalesce(held.s, scope) = scope)
                 ORDER BY next_attempt_at, id
                 LIMIT ?
                 FOR UPDATE SKIP LOCKED"
            )),
            take_ids: arc(format!(
                "UPDATE {outbox}
                 SET next_attempt_at = {LATER}, attempts = attempts + 1, lease_token = ?
                 WHERE id IN ({{list}})"
            )),
            rows_by_id: arc(format!("SELECT {columns} FROM {outbox} WHERE id IN ({{list}}) ORDER BY id")),
            outbox_row: arc(format!("SELECT {columns} FROM {outbox} WHERE id = ?")),
            dead_letters: arc(format!("SELECT {columns} FROM {outbox} WHERE dead ORDER BY id LIMIT ?")),
            // A stream's first offset starts below any real one, in this transaction only.
            ensure_offset: arc(format!(
                "INSERT INTO {offsets}
                    (consumer, stream, partition_id, position, sequence, updated_at)
                 VALUES (?, ?, ?, {MIN}, {MIN}, {NOW})
                 ON DUPLICATE KEY UPDATE position = position",
                MIN = i64::MIN
            )),
            // The WHERE makes an older offset a no-op, whatever order commits come in. An
            // UPDATE reads the row as last committed, after any lock on it: a batch's
            // offset moves only from where the batch before it left it, if given.
            move_offset: arc(format!(
                "UPDATE {offsets} SET position = ?, sequence = ?, updated_at = {NOW}
                 WHERE consumer = ? AND stream = ? AND partition_id = ?
                   AND (position, sequence) < (?, ?) AND (position, sequence) >= (?, ?)"
            )),
            // A new key starts as an expired lease that nobody held, in this transaction only.
            ensure_lease: arc(format!(
                "INSERT INTO {keys}
                    (scope, consumer, `key`, fingerprint, claim_id, processed_at, token, lease_until)
                 VALUES (?, ?, ?, ?, 0, {NOW}, 0, '1970-01-01')
                 ON DUPLICATE KEY UPDATE token = token"
            )),
            // An expired lease with the same payload is taken, with a larger token than the
            // last holder's, by the store's clock; a key in any other state changes nothing.
            lease_take_over: arc(format!(
                "UPDATE {keys}
                 SET token = token + 1, lease_until = {LATER}, processed_at = {NOW}
                 WHERE {this_key} AND fingerprint = ?
                   AND lease_until IS NOT NULL AND lease_until <= {NOW}"
            )),
            lease_token: arc(format!("SELECT token FROM {keys} WHERE {this_key}")),
            // MySQL has no RETURNING: `LAST_INSERT_ID(expr)` hands the updated count back
            // in the statement's answer, in one statement committed on its own. A row
            // inserted leaves it 0.
            record_run: arc(format!(
                "INSERT INTO {runs} (scope, consumer, `key`, runs, last_run_at)
                 VALUES (?, ?, ?, 1, {NOW})
                 ON DUPLICATE KEY UPDATE runs = LAST_INSERT_ID(runs + 1), last_run_at = {NOW}"
            )),
            // A key counted meanwhile by another process is left as it is, and reported
            // as counted (`CLIENT_FOUND_ROWS`): it has a first run counted either way.
            record_first_runs: arc(format!(
                "INSERT INTO {runs} (scope, consumer, `key`, runs, last_run_at)
                 SELECT ?, ?, batch.`key`, 1, {NOW} FROM ({{rows}}) AS batch
                 WHERE NOT EXISTS (
                    SELECT 1 FROM {runs} AS counted
                    WHERE counted.scope = ? AND counted.consumer = ?
                      AND counted.`key` IN ({{list}})
                 )
                 ON DUPLICATE KEY UPDATE runs = runs"
            )),
        }
    }
}

/// A VARBINARY column read as text: the bytes were UTF-8 when they were written, and sqlx
/// decodes only text columns as strings.
fn text(column: &str) -> String {
    format!("CAST({column} AS CHAR CHARACTER SET utf8mb4)")
}

/// The most placeholders MariaDB and MySQL take in one statement.
pub(crate) const MAX_PARAMETERS: usize = 65_535;

/// The most keys one statement carries: a batch insert binds five per key, within
/// [`MAX_PARAMETERS`].
pub(crate) const KEYS_PER_STATEMENT: usize = 10_000;

/// One key's row in the list of the batch insert.
pub(crate) fn insert_many_row() -> String {
    format!("(?, ?, ?, ?, ?, {NOW})")
}

/// One row's values in the list of [`MySqlStatements::forward_many`].
pub(crate) fn forward_many_row() -> String {
    format!("(?, ?, ?, ?, ?, {NOW}, {NOW}, {NOW})")
}

/// `template` with `{list}` replaced by `count` copies of `item`, comma separated.
pub(super) fn with_list(template: &str, item: &str, count: usize) -> String {
    template.replace("{list}", &vec![item; count].join(", "))
}

/// `template` with `{list}` replaced by `count` parameters as a relation of one column,
/// `key`.
pub(crate) fn with_keys(template: &str, count: usize) -> String {
    let rest = " UNION ALL SELECT ?".repeat(count.saturating_sub(1));
    template.replace("{list}", &format!("SELECT ? AS `key`{rest}"))
}
