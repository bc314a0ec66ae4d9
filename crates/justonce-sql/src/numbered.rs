//! What PostgreSQL and SQLite write alike: numbered parameters, `ON CONFLICT` and
//! `RETURNING`. The statements here differ between the two only in their clock, which
//! each supplies with its own statements; so do the steps that send them.

use crate::backend::{Backend, Queries, Reads};
use crate::common::{
    Common, EVENT_STATE, REPLAYED, apply_migrations, bind_claim, bind_identity_as,
    dashboard_minutes, failed_histories,
};
use crate::rows::{
    Announce, ClaimRow, NewOutboxRow, OffsetRow, OutboxRow, OutboxTuple, Stored, Which,
};
use crate::shared::{driver_error, vanished};
use crate::tables::Tables;
use justonce_core::{Consumer, Error, Fingerprint, Identity, Offset, Scope};
use sqlx::{AssertSqlSafe, Decode, Encode, Executor, IntoArguments, Type};
use std::sync::Arc;

/// The statements of one table prefix on PostgreSQL or SQLite, built once.
#[derive(Debug)]
pub struct Statements {
    pub(crate) common: Common,
    pub(crate) claim: Arc<str>,
    pub(crate) claim_and_forward: Option<Arc<str>>,
    pub(crate) claim_and_forward_many: Option<Arc<str>>,
    pub(crate) insert_many: Arc<str>,
    pub(crate) insert_many_at_offsets: Option<Arc<str>>,
    pub(crate) find_many: Arc<str>,
    pub(crate) enqueue: Arc<str>,
    pub(crate) forward_many: Arc<str>,
    pub(crate) enqueue_notifying: Arc<str>,
    pub(crate) take_due: Arc<str>,
    pub(crate) outbox_row: Arc<str>,
    pub(crate) dead_letters: Arc<str>,
    pub(crate) commit_offset: Arc<str>,
    pub(crate) commit_offset_after: Arc<str>,
    pub(crate) lease_claim: Arc<str>,
    /// scope, consumer, key: returns the runs started, this one included.
    pub(crate) record_run: Arc<str>,
    /// scope, consumer, keys (see [`Specific::keys_given`]): counts a first run of each
    /// unless one of them has runs counted.
    pub(crate) record_first_runs: Arc<str>,
}

impl AsRef<Common> for Statements {
    fn as_ref(&self) -> &Common {
        &self.common
    }
}

/// The statements whose text differs between PostgreSQL and SQLite beyond the clock.
pub(crate) struct Specific {
    pub(crate) claim: String,
    /// The claim and a forwarding outbox row in one statement, where the database can.
    pub(crate) claim_and_forward: Option<String>,
    /// `claim_and_forward` for the calls of a shared commit, where the database can.
    pub(crate) claim_and_forward_many: Option<String>,
    pub(crate) insert_many: String,
    /// `insert_many` with the offsets of the batch's partitions moved in it, where the
    /// database can.
    pub(crate) insert_many_at_offsets: Option<String>,
    pub(crate) find_many: String,
    /// The keys given as `$3` (an array on PostgreSQL, a JSON array on SQLite) as a
    /// relation of one column, `key`, under the alias given.
    pub(crate) keys_given: fn(&str) -> String,
    pub(crate) has_unique_constraint: String,
    /// consumer, milliseconds, limit.
    pub(crate) purge_keys: String,
    /// Writes an outbox row; whoever commits it wakes the relays.
    pub(crate) enqueue: String,
    /// Forwarding outbox rows without a notification: all of them in one statement where
    /// the database can (arrays), else one.
    pub(crate) forward_many: String,
    /// `enqueue` with a NOTIFY at commit, where relays listen for one.
    pub(crate) enqueue_notifying: Option<String>,
    /// What makes concurrent relays skip each other's rows: `FOR UPDATE SKIP LOCKED`.
    pub(crate) skip_locked: &'static str,
    /// A query of the lanes held back, a JSON array given as the parameter named (see
    /// [`Which::Due`]), that matches the outer row's `destination` and `scope`.
    pub(crate) held_back: fn(&str) -> String,
    /// The assignment that appends one attempt to a row's history, keeping the last
    /// [`HISTORY_LENGTH`](crate::rows::HISTORY_LENGTH): its duration, status, answer and
    /// error as the parameters (or `NULL`) named.
    pub(crate) append_attempt: fn(&str, &str, &str, &str) -> String,
    /// The function that gives where its second argument first occurs in its first,
    /// counted from 1, and 0 where it does not: text matched as it is, wildcards none.
    pub(crate) position: &'static str,
    /// The history column read as JSON text.
    pub(crate) history_text: &'static str,
    /// Run first in a replay's transaction: what keeps replays apart beyond it.
    pub(crate) replay_lock: Option<String>,
}

/// The store's clock in a database's SQL: times are compared there, never in the worker.
pub(crate) struct Clock {
    pub(crate) now: &'static str,
    /// `now` moved by a number of milliseconds given as a parameter, such as `$2`.
    pub(crate) later_by: fn(&str) -> String,
    pub(crate) earlier_by: fn(&str) -> String,
    /// Milliseconds from a time column to now.
    pub(crate) age_ms: fn(&str) -> String,
    /// A time column as microseconds since the Unix epoch, exactly as stored.
    pub(crate) micros_of: fn(&str) -> String,
    /// The time of a number of microseconds since the Unix epoch given as a parameter.
    pub(crate) at_micros: fn(&str) -> String,
}

impl Statements {
    pub(crate) fn new(tables: &Tables, clock: &Clock, specific: Specific) -> Self {
        let Tables {
            keys,
            outbox,
            offsets,
            breakers,
            replays,
            duplicates,
            runs,
            ..
        } = tables;
        let now = clock.now;
        let (micros_of, at) = (clock.micros_of, clock.at_micros);
        // What a stored event is, read from its outbox row.
        let event_columns = format!(
            "id, scope, key, destination, {} AS received_us, {EVENT_STATE} AS state, attempts, \
             last_error",
            micros_of("received_at")
        );
        let event_detail = format!(
            "SELECT {event_columns}, payload, headers, {} FROM {outbox}",
            specific.history_text
        );
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
        // Every outbox read returns these columns, decoded as an `OutboxTuple`.
        let columns = format!(
            "id, scope, key, destination, payload, headers, attempts, last_error, dead, \
             sent_at IS NOT NULL AS sent, {} AS age_ms",
            (clock.age_ms)("created_at")
        );
        // Sent, due and dead rows, and the age of the oldest due one.
        let outbox_counts = format!(
            "count(CASE WHEN sent_at IS NOT NULL THEN 1 END),
             count(CASE WHEN sent_at IS NULL AND NOT dead THEN 1 END),
             count(CASE WHEN dead THEN 1 END),
             coalesce(max(CASE WHEN sent_at IS NULL AND NOT dead THEN {} END), 0)",
            (clock.age_ms)("created_at")
        );
        let skip_locked = specific.skip_locked;
        let append = specific.append_attempt;
        // Rows of one destination written (or replayed) within a window of time, its six
        // parameters numbered from `first`.
        let window = |first: usize| {
            let at = |n: usize| format!("${}", first + n);
            format!(
                "({} IS NULL OR destination = {})
                 AND ({} IS NULL OR created_at >= {})
                 AND ({} IS NULL OR created_at <= {})",
                at(0),
                at(1),
                at(2),
                (clock.earlier_by)(&at(3)),
                at(4),
                (clock.earlier_by)(&at(5)),
            )
        };
        // Rows of one state within a window, after an id.
        let list = |state: &str, order: &str| {
            format!(
                "SELECT id, scope, key, destination, attempts, last_error, {} AS age_ms,
                        -{} AS next_in_ms
                 FROM {outbox}
                 WHERE {state} AND {} AND ($7 IS NULL OR id > $8)
                 ORDER BY {order} LIMIT $9",
                (clock.age_ms)("created_at"),
                (clock.age_ms)("next_attempt_at"),
                window(1),
            )
        };
        let text = |sql: String| Arc::<str>::from(sql);
        let position = specific.position;
        // A listing of stored events, its key prefix's condition given.
        let events_where = |key_prefix: &str| {
            format!(
                "SELECT {event_columns} FROM {outbox}
                 WHERE ($1 IS NULL OR destination = $2)
                   AND {}
                   AND ($8 IS NULL OR {position}(key, $9) > 0)
                   AND ($10 IS NULL OR received_at >= {})
                   AND ($12 IS NULL OR received_at <= {})
                   AND ($14 IS NULL OR {EVENT_STATE} = $15)
                   AND ($16 IS NULL OR received_at > {}
                        OR (received_at = {} AND id > $19))
                 ORDER BY received_at, id LIMIT $20",
                key_prefix.replace("{position}", position),
                at("$11"),
                at("$13"),
                at("$17"),
                at("$18"),
            )
        };
        let common = Common {
            find: text(format!(
                "SELECT claim_id, fingerprint FROM {keys}
                 WHERE scope = $1 AND consumer = $2 AND key = $3"
            )),
            lease_state: text(format!(
                "SELECT fingerprint, lease_until IS NULL AS done, result,
                        CASE WHEN lease_until IS NULL THEN 0 ELSE -{} END AS remaining_ms
                 FROM {keys} WHERE scope = $1 AND consumer = $2 AND key = $3",
                (clock.age_ms)("lease_until")
            )),
            store_result: text(format!(
                "UPDATE {keys} SET result = $1
                 WHERE scope = $2 AND consumer = $3 AND key = $4"
            )),
            // The minimum, not the greatest age: the purge index finds it at once.
            oldest_key_age: text(format!(
                "SELECT coalesce({}, 0) FROM {keys} WHERE consumer = $1",
                (clock.age_ms)("min(processed_at)")
            )),
            key_counts: text(format!(
                "SELECT consumer, scope, count(*), count(lease_until) FROM {keys}
                 GROUP BY consumer, scope ORDER BY consumer, scope"
            )),
            outbox_stats: text(format!("SELECT {outbox_counts} FROM {outbox}")),
            destination_stats: text(format!(
                "SELECT destination, {outbox_counts} FROM {outbox}
                 GROUP BY destination ORDER BY destination"
            )),
            breakers: text(format!(
                "SELECT destination, scope, failures, -{}, {} FROM {breakers}
                 ORDER BY destination, scope",
                (clock.age_ms)("open_until"),
                (clock.age_ms)("updated_at")
            )),
            load_offsets: text(format!(
                "SELECT partition_id, position, sequence FROM {offsets}
                 WHERE consumer = $1 AND stream = $2 ORDER BY partition_id"
            )),
            all_offsets: text(format!(
                "SELECT consumer, stream, partition_id, position, sequence FROM {offsets}
                 ORDER BY consumer, stream, partition_id"
            )),
            has_unique_constraint: text(specific.has_unique_constraint),
            list_due: text(list("sent_at IS NULL AND NOT dead", "created_at, id")),
            list_dead: text(list("dead", "id")),
            history: text(format!(
                "SELECT {} FROM {outbox} WHERE id = $1",
                specific.history_text
            )),
            dashboard_minutes: text(dashboard_minutes(outbox, micros_of, &at("$1"), &at("$2"))),
            failed_histories: text(failed_histories(outbox, specific.history_text, &at("$1"))),
            duplicate_minutes: text(format!(
                "SELECT origin, minute, duplicates FROM {duplicates} WHERE minute >= $1"
            )),
            add_duplicates: text(format!(
                "INSERT INTO {duplicates} (minute, origin, duplicates) VALUES ($1, $2, $3)
                 ON CONFLICT (minute, origin)
                 DO UPDATE SET duplicates = {duplicates}.duplicates + excluded.duplicates"
            )),
            ids_by_key: text(format!(
                "SELECT id FROM {outbox} WHERE key = $1 ORDER BY id"
            )),
            events: text(events_where(
                "($3 IS NULL OR (key >= $4 AND ($5 IS NULL OR key < $6) AND {position}(key, $7) = 1))",
            )),
            events_in_key_range: text(events_where(
                "$3 IS NOT NULL AND key >= $4 AND $5 IS NOT NULL AND key < $6
                   AND {position}(key, $7) = 1",
            )),
            event_by_id: text(format!("{event_detail} WHERE id = $1")),
            events_by_key: text(format!("{event_detail} WHERE key = $1 ORDER BY id")),
            replayable: text(format!(
                "SELECT count(*) FROM {outbox}
                 WHERE destination = $1 AND received_at >= {} AND received_at <= coalesce({}, {now})
                   AND (sent_at IS NOT NULL OR dead)",
                at("$2"),
                at("$3")
            )),
            replay_lock: specific.replay_lock.map(text),
            running_replay: text(format!(
                "SELECT w.id FROM {replays} AS w
                 WHERE w.origin = $1 AND w.since_at <= coalesce({}, {now}) AND w.until_at >= {}
                   AND {replay_running}
                 ORDER BY w.id LIMIT 1",
                at("$2"),
                at("$3")
            )),
            insert_replay: text(format!(
                "INSERT INTO {replays} (id, origin, since_at, until_at, started_at, events)
                 VALUES ($1, $2, {}, coalesce({}, {now}), {now}, 0)",
                at("$3"),
                at("$4")
            )),
            replay_window: text(format!(
                "UPDATE {outbox} SET {REPLAYED}, created_at = {now}, next_attempt_at = {now},
                    replay_id = $1
                 WHERE destination = $2 AND received_at >= {}
                   AND received_at <= (SELECT until_at FROM {replays} WHERE id = $4)
                   AND (sent_at IS NOT NULL OR dead)",
                at("$3")
            )),
            count_replay: text(format!("UPDATE {replays} SET events = $1 WHERE id = $2")),
            replay_by_id: text(format!(
                "SELECT {replay_columns} FROM {replays} AS w WHERE w.id = $1"
            )),
            replays: text(format!(
                "SELECT {replay_columns} FROM {replays} AS w ORDER BY w.started_at DESC, w.id DESC
                 LIMIT $1"
            )),
            replay_event: text(format!(
                "UPDATE {outbox} SET {REPLAYED}, created_at = {now}, next_attempt_at = {now},
                    replay_id = NULL
                 WHERE id = $1 AND (sent_at IS NOT NULL OR dead)"
            )),
            replay_key: text(format!(
                "UPDATE {outbox} SET {REPLAYED}, created_at = {now}, next_attempt_at = {now},
                    replay_id = NULL
                 WHERE key = $1 AND (sent_at IS NOT NULL OR dead)"
            )),
            purge_events: text(format!(
                "DELETE FROM {outbox} WHERE id IN (
                    SELECT id FROM {outbox}
                    WHERE destination = $1 AND sent_at IS NOT NULL AND received_at < {}
                    LIMIT $3
                 )",
                (clock.earlier_by)("$2")
            )),
            purge_keys: text(specific.purge_keys),
            forget_runs: text(format!(
                "DELETE FROM {runs} WHERE scope = $1 AND consumer = $2 AND key = $3"
            )),
            // Few rows: only deliveries that may be re-runs are counted.
            purge_runs: text(format!(
                "DELETE FROM {runs} WHERE (scope, consumer, key) IN (
                    SELECT scope, consumer, key FROM {runs}
                    WHERE consumer = $1 AND last_run_at < {}
                    LIMIT $3
                 )",
                (clock.earlier_by)("$2")
            )),
            // Recorded only by the relay that took the row under this lease token, which a
            // replay takes away: a late relay's sent must not wipe an operator's replay.
            // It outranks a dead-lettering after the row's window ended while it was sent.
            // Like each outcome, it appends its attempt to the history in the same statement.
            mark_sent: text(format!(
                "UPDATE {outbox} SET {}, sent_at = {now}, dead = FALSE, last_error = NULL
                 WHERE id = $4 AND lease_token = $5",
                append("$1", "$2", "$3", "NULL")
            )),
            // Failures are recorded only by the relay that holds the lease: one whose lease
            // ran out must not cut short the new holder's attempt.
            mark_retry: text(format!(
                "UPDATE {outbox} SET {}, next_attempt_at = {}, last_error = $6,
                    last_failed_at = {now}
                 WHERE id = $7 AND lease_token = $8 AND sent_at IS NULL AND NOT dead",
                append("$1", "$2", "$3", "$4"),
                (clock.later_by)("$5")
            )),
            mark_dead: text(format!(
                "UPDATE {outbox} SET {}, dead = TRUE, last_error = $5, last_failed_at = {now}
                 WHERE id = $6 AND lease_token = $7 AND sent_at IS NULL AND NOT dead",
                append("$1", "$2", "$3", "$4")
            )),
            untake: text(format!(
                "UPDATE {outbox} SET next_attempt_at = {}, attempts = attempts - 1
                 WHERE id = $2 AND lease_token = $3 AND sent_at IS NULL AND NOT dead",
                (clock.later_by)("$1")
            )),
            // Leased rows too: should one be sent meanwhile, `mark_sent` outranks this.
            expire: text(format!(
                "UPDATE {outbox} SET dead = TRUE, last_error = $1
                 WHERE id IN (
                    SELECT id FROM {outbox}
                    WHERE sent_at IS NULL AND NOT dead AND destination = $2 AND scope = $3
                      AND created_at <= {}
                    ORDER BY id LIMIT $5
                 )",
                (clock.earlier_by)("$4")
            )),
            breaker_open: text(format!(
                "INSERT INTO {breakers} (destination, scope, failures, open_until, updated_at)
                 VALUES ($1, $2, $3, {}, {now})
                 ON CONFLICT (destination, scope) DO UPDATE SET failures = excluded.failures,
                    open_until = excluded.open_until, updated_at = excluded.updated_at",
                (clock.later_by)("$4")
            )),
            breaker_close: text(format!(
                "DELETE FROM {breakers} WHERE destination = $1 AND scope = $2"
            )),
            // A replay starts a new delivery window.
            replay: text(format!(
                "UPDATE {outbox}
                 SET {REPLAYED}, next_attempt_at = {now}, created_at = {now}
                 WHERE id IN (
                    SELECT id FROM {outbox}
                    WHERE dead AND sent_at IS NULL AND ($1 IS NULL OR id = $2) AND {}
                    ORDER BY id LIMIT $9
                 )",
                window(3)
            )),
            purge_dead: text(format!("DELETE FROM {outbox} WHERE dead AND {}", window(1))),
            purge_duplicates: text(format!(
                "DELETE FROM {duplicates} WHERE (minute, origin) IN (
                    SELECT minute, origin FROM {duplicates} WHERE minute < $1 LIMIT $2
                 )"
            )),
            purge_sent: text(format!(
                "DELETE FROM {outbox} WHERE id IN (
                    SELECT id FROM {outbox} WHERE sent_at < {} LIMIT $2
                 )",
                (clock.earlier_by)("$1")
            )),
            // Each change to a lease names its token: a holder whose lease was taken over
            // changes nothing.
            lease_complete: text(format!(
                "UPDATE {keys} SET lease_until = NULL, result = $1, processed_at = {now}
                 WHERE scope = $2 AND consumer = $3 AND key = $4 AND token = $5
                   AND lease_until IS NOT NULL"
            )),
            // A released key keeps its row, expired, so that the next holder's token is
            // still larger than this one's.
            lease_release: text(format!(
                "UPDATE {keys} SET lease_until = {now}
                 WHERE scope = $1 AND consumer = $2 AND key = $3 AND token = $4
                   AND lease_until IS NOT NULL"
            )),
            lease_renew: text(format!(
                "UPDATE {keys} SET lease_until = {}
                 WHERE scope = $2 AND consumer = $3 AND key = $4 AND token = $5
                   AND lease_until IS NOT NULL",
                (clock.later_by)("$1")
            )),
            // An operator's release is the lease running out now: the holder keeps its
            // token until the next claim takes the key over with a larger one.
            force_release: text(format!(
                "UPDATE {keys} SET lease_until = {now}
                 WHERE scope = $1 AND consumer = $2 AND key = $3 AND lease_until IS NOT NULL"
            )),
            // An operator's completion takes the key from its holder: the new token refuses
            // the holder's late complete, renew or release.
            force_complete: text(format!(
                "UPDATE {keys}
                 SET lease_until = NULL, result = $1, token = token + 1, processed_at = {now}
                 WHERE scope = $2 AND consumer = $3 AND key = $4 AND lease_until IS NOT NULL"
            )),
        };
        Self {
            common,
            claim: text(specific.claim),
            claim_and_forward: specific.claim_and_forward.map(text),
            claim_and_forward_many: specific.claim_and_forward_many.map(text),
            insert_many: text(specific.insert_many),
            insert_many_at_offsets: specific.insert_many_at_offsets.map(text),
            find_many: text(specific.find_many),
            enqueue_notifying: text(
                (specific.enqueue_notifying).unwrap_or_else(|| specific.enqueue.clone()),
            ),
            enqueue: text(specific.enqueue),
            forward_many: text(specific.forward_many),
            // Taking a row hides it until the lease ends, in one short statement: no lock
            // is held while it is sent, and a relay that dies leaves it due again. Rows are
            // chosen by due time, never by a cursor over ids, so a row committed after a
            // higher-numbered one is not skipped. The lanes the relay holds back ($4) are
            // left out, so that their rows do not crowd out the others'.
            take_due: text(format!(
                "UPDATE {outbox}
                 SET next_attempt_at = {}, attempts = attempts + 1, lease_token = $3
                 WHERE id IN (
                    SELECT id FROM {outbox}
                    WHERE sent_at IS NULL AND NOT dead AND next_attempt_at <= {now}
                      AND NOT EXISTS ({})
                    ORDER BY next_attempt_at, id
                    LIMIT $2
                    {skip_locked}
                 )
                 RETURNING {columns}",
                (clock.later_by)("$1"),
                (specific.held_back)("$4")
            )),
            outbox_row: text(format!("SELECT {columns} FROM {outbox} WHERE id = $1")),
            dead_letters: text(format!(
                "SELECT {columns} FROM {outbox} WHERE dead ORDER BY id LIMIT $1"
            )),
            // The WHERE makes an offset at or past the guard ($6, $7) a no-op in SQL,
            // whatever order commits come in.
            commit_offset: text(format!(
                "INSERT INTO {offsets} (consumer, stream, partition_id, position, sequence, updated_at)
                 VALUES ($1, $2, $3, $4, $5, {now})
                 ON CONFLICT (consumer, stream, partition_id) DO UPDATE
                 SET position = excluded.position, sequence = excluded.sequence,
                     updated_at = excluded.updated_at
                 WHERE ({offsets}.position, {offsets}.sequence) < ($6, $7)
                 RETURNING position, sequence"
            )),
            // After a batch whose transaction is open: the UPDATE waits for its row lock,
            // and the CASE reads the row as that batch left it (PostgreSQL's read committed
            // re-reads a row it waited for; a WHERE would be judged on the row before).
            // Moved if the offset it returns is the new one, as with the one above.
            commit_offset_after: text(format!(
                "UPDATE {offsets}
                 SET (position, sequence, updated_at) = (
                     CASE WHEN {moves} THEN $4 ELSE position END,
                     CASE WHEN {moves} THEN $5 ELSE sequence END,
                     {now})
                 WHERE consumer = $1 AND stream = $2 AND partition_id = $3
                 RETURNING position, sequence",
                moves = "(position, sequence) < ($6, $7) AND (position, sequence) >= ($8, $9)"
            )),
            // Takes a free key, or an expired lease on it with the same payload, with a
            // larger token than the last holder's. A key in any other state returns no
            // row, and `lease_state` says which.
            lease_claim: text(format!(
                "INSERT INTO {keys}
                    (scope, consumer, key, fingerprint, claim_id, processed_at, token, lease_until)
                 VALUES ($1, $2, $3, $4, 0, {now}, 1, {later})
                 ON CONFLICT (scope, consumer, key) DO UPDATE
                 SET token = {keys}.token + 1, lease_until = excluded.lease_until,
                     processed_at = excluded.processed_at
                 WHERE {keys}.lease_until IS NOT NULL AND {keys}.lease_until <= {now}
                   AND {keys}.fingerprint = excluded.fingerprint
                 RETURNING token",
                later = (clock.later_by)("$5")
            )),
            // One statement, committed on its own: the count holds even if the run that
            // follows ends the process.
            record_run: text(format!(
                "INSERT INTO {runs} (scope, consumer, key, runs, last_run_at)
                 VALUES ($1, $2, $3, 1, {now})
                 ON CONFLICT (scope, consumer, key) DO UPDATE
                 SET runs = {runs}.runs + 1, last_run_at = excluded.last_run_at
                 RETURNING runs"
            )),
            record_first_runs: text(format!(
                "INSERT INTO {runs} (scope, consumer, key, runs, last_run_at)
                 SELECT $1, $2, batch.key, 1, {now} FROM {batch}
                 WHERE NOT EXISTS (
                    SELECT 1 FROM {runs} AS counted
                    WHERE counted.scope = $1 AND counted.consumer = $2
                      AND counted.key IN (SELECT listed.key FROM {listed})
                 )
                 ON CONFLICT (scope, consumer, key) DO NOTHING",
                batch = (specific.keys_given)("batch"),
                listed = (specific.keys_given)("listed"),
            )),
        }
    }
}

impl<DB> Queries<DB> for Statements
where
    DB: Backend<Statements = Statements>,
    Statements: Reads<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q, 'r> i64: Encode<'q, DB> + Decode<'r, DB> + Type<DB>,
    for<'q> i32: Encode<'q, DB> + Type<DB>,
    for<'r> OutboxTuple: sqlx::FromRow<'r, DB::Row>,
    for<'r> (i64, Vec<u8>): sqlx::FromRow<'r, DB::Row>,
    for<'r> (i64,): sqlx::FromRow<'r, DB::Row>,
    for<'r> (i64, i64): sqlx::FromRow<'r, DB::Row>,
{
    async fn claim<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        row: ClaimRow<'a>,
    ) -> Result<Stored, Error> {
        let id = row.identity;
        let holder: Option<(i64, Vec<u8>)> =
            bind_claim(sqlx::query_as(AssertSqlSafe(self.claim.clone())), row)
                .fetch_optional(&mut *conn)
                .await
                .map_err(driver_error::<DB>)?;
        match holder {
            Some((claim_id, fingerprint)) => Stored::decode(claim_id, fingerprint),
            // No row: a holder committed after the statement's snapshot was taken
            // (PostgreSQL), or the insert found the key taken (SQLite, whose write lock
            // keeps the holder in place). Read it now.
            None => self.find(conn, id).await?.ok_or_else(|| vanished(id)),
        }
    }

    async fn lease_claim<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        identity: &'a Identity,
        fingerprint: &'a Fingerprint,
        lease_ms: i64,
    ) -> Result<Option<i64>, Error> {
        let lease_claim = sqlx::query_as(AssertSqlSafe(self.lease_claim.clone()));
        let token: Option<(i64,)> = bind_identity_as(lease_claim, identity)
            .bind(fingerprint.as_bytes().as_slice())
            .bind(lease_ms)
            .fetch_optional(pool)
            .await
            .map_err(driver_error::<DB>)?;
        Ok(token.map(|(token,)| token))
    }

    async fn enqueue<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        row: NewOutboxRow<'a>,
        announce: Announce,
    ) -> Result<i64, Error> {
        let text = match announce {
            Announce::AtCommit => &self.enqueue_notifying,
            Announce::AfterCommit => &self.enqueue,
        };
        let (id,): (i64,) = sqlx::query_as(AssertSqlSafe(text.clone()))
            .bind(row.scope)
            .bind(row.key)
            .bind(row.destination)
            .bind(row.payload)
            .bind(row.headers)
            .fetch_one(conn)
            .await
            .map_err(driver_error::<DB>)?;
        Ok(id)
    }

    async fn outbox_rows<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        which: Which,
    ) -> Result<Vec<OutboxRow>, Error> {
        let query = match which {
            Which::Due {
                lease_ms,
                limit,
                token,
                held_back,
            } => sqlx::query_as(AssertSqlSafe(self.take_due.clone()))
                .bind(lease_ms)
                .bind(limit)
                .bind(token)
                .bind(held_back),
            Which::Id(id) => sqlx::query_as(AssertSqlSafe(self.outbox_row.clone())).bind(id),
            Which::DeadLetters { limit } => {
                sqlx::query_as(AssertSqlSafe(self.dead_letters.clone())).bind(limit)
            }
        };
        let rows: Vec<OutboxTuple> = query.fetch_all(pool).await.map_err(driver_error::<DB>)?;
        Ok(rows.into_iter().map(OutboxRow::from).collect())
    }

    async fn commit_offset<'a>(
        &'a self,
        conn: &'a mut DB::Connection,
        at: OffsetRow<'a>,
    ) -> Result<bool, Error> {
        let (sql, at_least) = match at.at_least {
            None => (&self.commit_offset, None),
            Some(at_least) => (&self.commit_offset_after, Some(at_least)),
        };
        let mut query = sqlx::query_as(AssertSqlSafe(sql.clone()))
            .bind(at.consumer)
            .bind(at.stream)
            .bind(at.partition)
            .bind(at.offset.position)
            .bind(at.offset.sequence)
            .bind(at.above.position)
            .bind(at.above.sequence);
        if let Some(at_least) = at_least {
            query = query.bind(at_least.position).bind(at_least.sequence);
        }
        let stored: Option<(i64, i64)> = query
            .fetch_optional(conn)
            .await
            .map_err(driver_error::<DB>)?;
        Ok(stored.is_some_and(|(position, sequence)| Offset::new(position, sequence) == at.offset))
    }

    async fn record_run<'a>(
        &'a self,
        pool: &'a sqlx::Pool<DB>,
        identity: &'a Identity,
    ) -> Result<u64, Error> {
        let (runs,): (i64,) = bind_identity_as(
            sqlx::query_as(AssertSqlSafe(self.record_run.clone())),
            identity,
        )
        .fetch_one(pool)
        .await
        .map_err(driver_error::<DB>)?;
        Ok(runs.unsigned_abs())
    }
}

/// Applies the missing migrations in one transaction, begun as the database's writers
/// begin theirs, which keeps concurrent migrators apart.
pub(crate) async fn migrate_in_transaction<DB>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
) -> Result<usize, Error>
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q, 'r> i64: Encode<'q, DB> + Decode<'r, DB> + Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let mut tx = crate::pool::begin(pool).await.map_err(driver_error::<DB>)?;
    let applied = apply_migrations::<DB>(&mut tx, tables).await?;
    tx.commit().await.map_err(driver_error::<DB>)?;
    Ok(applied)
}

/// [`Backend::record_first_runs`], with the keys given as `keys`: an array on PostgreSQL, a
/// JSON array on SQLite.
pub(crate) async fn record_first_runs<DB, Keys>(
    pool: &sqlx::Pool<DB>,
    sql: &Statements,
    scope: &Scope,
    consumer: &Consumer,
    keys: Keys,
) -> Result<u64, Error>
where
    DB: Backend,
    for<'c> &'c sqlx::Pool<DB>: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Keys: Encode<'q, DB> + Type<DB>,
{
    let done = sqlx::query(AssertSqlSafe(sql.record_first_runs.clone()))
        .bind(scope.as_str())
        .bind(consumer.as_str())
        .bind(keys)
        .execute(pool)
        .await
        .map_err(driver_error::<DB>)?;
    Ok(DB::rows_affected(&done))
}

/// The stored rows of a batch's keys, given as `keys`: an array on PostgreSQL, a JSON
/// array on SQLite.
pub(crate) async fn find_many<DB, Keys>(
    conn: &mut DB::Connection,
    sql: &Statements,
    scope: &Scope,
    consumer: &Consumer,
    keys: Keys,
) -> Result<Vec<(String, Stored)>, Error>
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Keys: Encode<'q, DB> + Type<DB>,
    for<'r> (String, i64, Vec<u8>): sqlx::FromRow<'r, DB::Row>,
{
    let rows: Vec<(String, i64, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(sql.find_many.clone()))
        .bind(scope.as_str())
        .bind(consumer.as_str())
        .bind(keys)
        .fetch_all(conn)
        .await
        .map_err(driver_error::<DB>)?;
    rows.into_iter()
        .map(|(key, claim_id, fingerprint)| Ok((key, Stored::decode(claim_id, fingerprint)?)))
        .collect()
}
