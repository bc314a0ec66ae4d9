//! PostgreSQL's statements: those written for it alone, and its clock for those it writes
//! as SQLite does.

use crate::numbered::{Clock, Specific, Statements};
use crate::rows::HISTORY_LENGTH;
use crate::tables::Tables;

const CLOCK: Clock = Clock {
    now: "now()",
    later_by: |millis| format!("now() + {millis} * interval '1 millisecond'"),
    earlier_by: |millis| format!("now() - {millis} * interval '1 millisecond'"),
    age_ms: |column| format!("(extract(epoch FROM now() - {column}) * 1000)::bigint"),
    // `extract` returns an exact numeric, and an interval of whole microseconds is exact.
    micros_of: |column| format!("(extract(epoch FROM {column}) * 1000000)::bigint"),
    at_micros: |micros| format!("(timestamptz 'epoch' + {micros} * interval '1 microsecond')"),
};

/// The statements of the tables under one prefix.
pub(super) fn statements(tables: &Tables) -> Statements {
    let Tables {
        prefix,
        keys,
        outbox,
        offsets,
        ..
    } = tables;
    // One index lookup per key of a batch, whatever the planner knows of the table: its
    // generic plan for `key = ANY($3)` can instead test every row of the consumer
    // against every key (40 times slower with 16,000 keys stored, and growing).
    let find_one = format!(
        "SELECT key, claim_id, fingerprint FROM {keys}
         WHERE scope = $1 AND consumer = $2 AND key = batch.key
         LIMIT 1"
    );
    let specific = Specific {
        // The second SELECT reads the holder of a key that was committed before this
        // statement began. A holder that commits while the INSERT waits for it is not
        // in this statement's snapshot: the statement returns no row, and the caller
        // asks again with `find`.
        claim: format!(
            "WITH inserted AS (
                INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id)
                VALUES ($1, $2, $3, $4, $5)
                ON CONFLICT (scope, consumer, key) DO NOTHING
                RETURNING claim_id, fingerprint
             )
             SELECT claim_id, fingerprint FROM inserted
             UNION ALL
             SELECT claim_id, fingerprint FROM {keys}
             WHERE scope = $1 AND consumer = $2 AND key = $3
               AND NOT EXISTS (SELECT FROM inserted)"
        ),
        // Rows are inserted, and so locked, in key order: two batches that share keys
        // wait for each other instead of deadlocking. The same statement reads the keys
        // that were not inserted, as held before it began (its snapshot does not see
        // its own inserts); a key committed by another transaction while it ran is in
        // neither half, and is read with find_many.
        insert_many: insert_many(keys, &find_one, None),
        // The same with the offsets of a batch's partitions moved in the statement, each
        // only past a stored offset below its span's first ($10, $11), and the count of
        // those moved in a row of its own, its key NULL.
        insert_many_at_offsets: Some(insert_many(keys, &find_one, Some(offsets))),
        keys_given: |alias| format!("unnest($3::text[]) AS {alias} (key)"),
        find_many: format!(
            "SELECT held.key, held.claim_id, held.fingerprint
             FROM unnest($3::text[]) AS batch (key)
             CROSS JOIN LATERAL ({find_one}) AS held"
        ),
        has_unique_constraint: format!(
            "SELECT count(*) FROM pg_index AS i
             WHERE i.indrelid = to_regclass('{keys}')
               AND i.indisunique AND i.indpred IS NULL AND i.indnkeyatts = 3
               AND (SELECT array_agg(a.attname::text ORDER BY a.attname)
                    FROM pg_attribute AS a
                    WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey))
                   = ARRAY['consumer', 'key', 'scope']"
        ),
        purge_keys: format!(
            "DELETE FROM {keys} WHERE (scope, consumer, key) IN (
                SELECT scope, consumer, key FROM {keys}
                WHERE consumer = $1
                  AND processed_at < now() - $2 * interval '1 millisecond'
                LIMIT $3
                FOR UPDATE SKIP LOCKED
             )"
        ),
        // A batch of one call, numbered as `claim` with the outbox row's values after it.
        claim_and_forward: Some(claim_and_forward(
            keys,
            outbox,
            "SELECT $1::text AS scope, $2::text AS consumer, $3::text AS key,
                    $4::bytea AS fingerprint, $6::text AS destination, $7::bytea AS payload,
                    $8::text AS headers, 1::bigint AS place",
            "$5",
        )),
        // The calls of a shared commit, one array for each column, in the order they came.
        claim_and_forward_many: Some(claim_and_forward(
            keys,
            outbox,
            "SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[],
                                  $6::bytea[], $7::text[])
             WITH ORDINALITY
             AS batch (scope, consumer, key, fingerprint, destination, payload, headers, place)",
            "$8",
        )),
        // In a transaction justonce commits, which wakes the relays after its commit.
        forward_many: format!(
            "INSERT INTO {outbox} (scope, key, destination, payload, headers)
             SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[])"
        ),
        enqueue: format!(
            "INSERT INTO {outbox} (scope, key, destination, payload, headers)
             VALUES ($1, $2, $3, $4, $5)
             RETURNING id"
        ),
        // For the user's own transaction, whose commit justonce does not see: the
        // notification goes with it. One per channel and transaction, whatever the number
        // of rows: PostgreSQL folds identical ones.
        enqueue_notifying: Some(format!(
            "WITH inserted AS (
                INSERT INTO {outbox} (scope, key, destination, payload, headers)
                VALUES ($1, $2, $3, $4, $5)
                RETURNING id
             ), notified AS (SELECT pg_notify('{outbox}', ''))
             SELECT id FROM inserted, notified"
        )),
        skip_locked: "FOR UPDATE SKIP LOCKED",
        held_back: |array| {
            format!(
                "SELECT 1 FROM json_array_elements({array}::json) AS held(lane)
                 WHERE held.lane->>0 = destination AND coalesce(held.lane->>1, scope) = scope"
            )
        },
        // The oldest attempt is dropped once the history is full.
        append_attempt: |duration, status, answer, error| {
            format!(
                "history = (CASE WHEN jsonb_array_length(coalesce(history, '[]')) >= {HISTORY_LENGTH}
                                 THEN history - 0 ELSE coalesce(history, '[]') END)
                    || jsonb_build_array(jsonb_build_object(
                        'attempt', attempts, 'at', (extract(epoch FROM now()) * 1000)::bigint,
                        'ms', {duration}::bigint, 'status', {status}::bigint,
                        'answer', {answer}::text, 'error', {error}::text))"
            )
        },
        position: "strpos",
        history_text: "history::text",
        // Held until the replay's transaction ends: replays of one store run one at a time.
        replay_lock: Some(format!(
            "SELECT pg_advisory_xact_lock(hashtext('justonce:{prefix}:replays'))"
        )),
    };
    Statements::new(tables, &CLOCK, specific)
}

/// The claims of the calls in `batch`, and the outbox rows of those whose key it inserted,
/// in one statement; the rows carry the claim id `claim_id`. `batch` is a query of the
/// columns scope, consumer, key, fingerprint, destination, payload, headers and place (the
/// call's place from 1), with no key twice. It returns a row for each place: the claim id
/// and fingerprint of the row holding the key afterwards, or NULLs where a holder committed
/// after the statement's snapshot (the caller asks again). The holder is read by one index
/// lookup per key (the LIMIT keeps the planner from joining the whole table instead), and
/// only for keys the statement did not insert.
///
/// Keys are inserted, and so locked, sorted by scope, consumer and key, as a transaction's
/// claims are: statements and transactions sharing keys wait for each other instead of
/// deadlocking. The outbox rows are written in the calls' order. A data-modifying WITH runs
/// whether or not it is read. No NOTIFY here: it would make these commits queue for one
/// lock; the caller wakes the relays after it.
fn claim_and_forward(keys: &str, outbox: &str, batch: &str, claim_id: &str) -> String {
    format!(
        "WITH batch AS ({batch}),
         inserted AS (
            INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id)
            SELECT scope, consumer, key, fingerprint, {claim_id}::bigint FROM batch
            ORDER BY scope COLLATE \"C\", consumer COLLATE \"C\", key COLLATE \"C\"
            ON CONFLICT (scope, consumer, key) DO NOTHING
            RETURNING scope, consumer, key, claim_id, fingerprint
         ), queued AS (
            INSERT INTO {outbox} (scope, key, destination, payload, headers)
            SELECT batch.scope, batch.key, batch.destination, batch.payload, batch.headers
            FROM batch JOIN inserted USING (scope, consumer, key)
            ORDER BY batch.place
         )
         SELECT batch.place, coalesce(inserted.claim_id, held.claim_id),
                coalesce(inserted.fingerprint, held.fingerprint)
         FROM batch
         LEFT JOIN inserted USING (scope, consumer, key)
         LEFT JOIN LATERAL (
            SELECT claim_id, fingerprint FROM {keys}
            WHERE scope = batch.scope AND consumer = batch.consumer AND key = batch.key
              AND inserted.key IS NULL
            LIMIT 1
         ) AS held ON true"
    )
}

/// The text of the error [`claim_with_effect`] raises when its effect changed rows while
/// `claimed` was empty.
pub(super) const UNCLAIMED_EFFECT: &str = "justonce: the effect changed rows without a claim";

/// The claim of a key and an effect's statement in one statement: the effect reads the
/// claim's inserted row as `claimed`, so that it does nothing when the key was held.
/// `binds` is how many parameters the effect has; the claim's come after them. What it
/// returns is the claim's, as for `claim`, with the rows the effect changed; one row always,
/// NULL where the key's row is not seen.
///
/// An effect that changed rows while `claimed` was empty did not read it as a relation: a
/// cast of [`UNCLAIMED_EFFECT`] fails then, and the whole statement with it. The guard's
/// row is the left side of a LEFT JOIN, so that it is evaluated even when no key row is.
pub(super) fn claim_with_effect(keys: &str, effect: &str, binds: usize) -> String {
    let [scope, consumer, key, fingerprint, claim_id] =
        std::array::from_fn(|place| format!("${}", binds + place + 1));
    let column = crate::effect::CLAIMED_COLUMN;
    // Names that clash with none of the effect's tables.
    format!(
        "WITH justonce_claim AS (
            INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id)
            VALUES ({scope}, {consumer}, {key}, {fingerprint}, {claim_id})
            ON CONFLICT (scope, consumer, key) DO NOTHING
            RETURNING claim_id, fingerprint
         ), claimed AS (
            SELECT 1 AS {column} FROM justonce_claim
         ), justonce_effect AS (
            {effect}
            RETURNING 1
         ), justonce_changed AS (
            SELECT CASE WHEN count(*) = 0 OR EXISTS (SELECT FROM claimed) THEN count(*)
                   ELSE ('{UNCLAIMED_EFFECT}: ' || count(*))::bigint END AS changed
            FROM justonce_effect
         )
         SELECT justonce_held.claim_id, justonce_held.fingerprint, justonce_changed.changed
         FROM justonce_changed LEFT JOIN (
            SELECT claim_id, fingerprint FROM justonce_claim
            UNION ALL
            SELECT claim_id, fingerprint FROM {keys}
            WHERE scope = {scope} AND consumer = {consumer} AND key = {key}
              AND NOT EXISTS (SELECT FROM justonce_claim)
         ) AS justonce_held ON true"
    )
}

/// The statement that claims a batch's keys (see `insert_many` in [`statements`]), with the
/// offsets of its partitions moved in it when `offsets` names their table. The offsets'
/// count is read last, so that the keys are locked before the offsets, as a reader running
/// entries one by one locks them: two readers at a partition's handover cannot deadlock.
fn insert_many(keys: &str, find_one: &str, offsets: Option<&str>) -> String {
    let (moving, moved, no_moves) = match offsets {
        Some(offsets) => (
            format!(
                "spans AS (
                    SELECT * FROM unnest(
                        $6::text[], $7::int4[], $8::int8[], $9::int8[], $10::int8[], $11::int8[]
                    ) AS span (stream, partition_id, position, sequence, above_position, above_sequence)
                 ),
                 moved AS (
                    INSERT INTO {offsets} (consumer, stream, partition_id, position, sequence, updated_at)
                    SELECT $2, stream, partition_id, position, sequence, now() FROM spans
                    ON CONFLICT (consumer, stream, partition_id) DO UPDATE
                    SET position = excluded.position, sequence = excluded.sequence,
                        updated_at = excluded.updated_at
                    WHERE ({offsets}.position, {offsets}.sequence) < (
                        SELECT above_position, above_sequence FROM spans
                        WHERE spans.stream = excluded.stream
                          AND spans.partition_id = excluded.partition_id
                    )
                    RETURNING 1
                 ),"
            ),
            "
             UNION ALL
             SELECT NULL, NULL, NULL, (SELECT count(*) FROM moved)",
            ", NULL::bigint",
        ),
        None => (String::new(), "", ""),
    };
    format!(
        "WITH {moving} inserted AS (
            INSERT INTO {keys} (scope, consumer, key, fingerprint, claim_id)
            SELECT $1, $2, batch.key, batch.fingerprint, $5
            FROM unnest($3::text[], $4::bytea[]) AS batch (key, fingerprint)
            ORDER BY batch.key COLLATE \"C\"
            ON CONFLICT (scope, consumer, key) DO NOTHING
            RETURNING key
         )
         SELECT key, NULL::bigint, NULL::bytea{no_moves} FROM inserted
         UNION ALL
         SELECT held.key, held.claim_id, held.fingerprint{no_moves}
         FROM unnest($3::text[]) AS batch (key)
         CROSS JOIN LATERAL ({find_one}) AS held
         WHERE batch.key NOT IN (SELECT key FROM inserted){moved}"
    )
}
