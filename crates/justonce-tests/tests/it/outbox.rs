//! The outbox and its relay: rows written with the work, sent afterwards with their key,
//! retried, dead-lettered and replayed; and stream offsets kept with the work.

use super::{key, on_every_database};
use justonce_sql::{
    Consumer, Delivered, Delivery, Destination, Inbox, InboxOptions, Message, Offset, OffsetCommit,
    OffsetSpan, Outcome, RelayOptions, RelayRound,
};
use justonce_tests::{RunningRelay, TestBackend, TestDb};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

on_every_database!(
    the_relay_sends_each_row_with_its_derived_key,
    failures_are_retried_dead_lettered_and_replayed_with_the_same_key,
    retries_stop_after_the_last_attempt,
    dead_letters_are_replayed_in_batches_oldest_first,
    a_row_for_an_unknown_destination_is_retried,
    sent_rows_are_purged_after_their_retention,
    offsets_never_move_backwards,
    a_batch_moves_its_partitions_offsets_with_its_work_or_not_at_all,
    a_batch_after_another_commits_only_once_that_one_did,
    a_killed_reader_resumes_at_its_stored_offset,
    a_row_past_its_delivery_window_is_dead_lettered,
    run_forward_writes_one_row_with_the_key_and_skips_what_was_seen,
    run_forward_racing_on_one_key_writes_one_row,
    stats_count_each_destination_apart,
    a_forwarded_row_wakes_the_relay_of_its_process,
);

/// One delivery as the destination saw it: row id, key, payload.
type Seen = (i64, String, Vec<u8>);

/// A destination that records every delivery and answers from a script (then `Sent`).
#[derive(Clone, Default)]
struct Recorder {
    script: Arc<Mutex<VecDeque<Delivered>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Recorder {
    fn answering(answers: impl IntoIterator<Item = Delivered>) -> Self {
        let recorder = Self::default();
        recorder.script.lock().unwrap().extend(answers);
        recorder
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Destination for Recorder {
    fn deliver<'a>(
        &'a self,
        delivery: Delivery<'a>,
    ) -> Pin<Box<dyn Future<Output = Delivered> + Send + 'a>> {
        self.seen.lock().unwrap().push((
            delivery.id,
            delivery.key.to_owned(),
            delivery.payload.to_vec(),
        ));
        let answer = self.script.lock().unwrap().pop_front();
        Box::pin(async move { answer.unwrap_or(Delivered::Sent) })
    }
}

fn retry(reason: &str) -> Delivered {
    Delivered::Retry {
        after: None,
        reason: reason.to_owned(),
    }
}

/// Options under which a failed row is due again at once.
fn eager() -> RelayOptions {
    RelayOptions::default()
        .first_backoff(Duration::ZERO)
        .max_backoff(Duration::ZERO)
}

/// Runs `inbox`'s work for `key`: one outbox row for `step`.
async fn enqueue<DB: TestBackend>(inbox: &Inbox<DB>, key: &str, step: &str) -> i64 {
    let key = justonce_sql::Key::new(key).unwrap();
    let outcome = inbox
        .run(&key, step.as_bytes(), |tx| {
            Box::pin(inbox.enqueue(tx, &key, step, Message::new("sink", step)))
        })
        .await
        .expect("run");
    outcome.processed().expect("a new key")
}

async fn the_relay_sends_each_row_with_its_derived_key<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let (billing, audit) = (db.consumer("billing"), db.consumer("audit"));
    let first = enqueue(&billing, "evt_1", "email").await;
    let second = enqueue(&audit, "evt_1", "email").await;
    let sink = Recorder::default();
    let relay = db.inbox.outbox().relay().destination("sink", sink.clone());

    let round = relay.relay_once().await.unwrap();
    assert_eq!((round.taken, round.sent), (2, 2));
    assert_eq!(relay.relay_once().await.unwrap(), RelayRound::default());
    let expected = |inbox: &Inbox<DB>| inbox.identity(&key("evt_1")).derive("email").to_string();
    assert_eq!(
        sink.seen(),
        vec![
            (first, expected(&billing), b"email".to_vec()),
            (second, expected(&audit), b"email".to_vec()),
        ]
    );
    assert_ne!(expected(&billing), expected(&audit));
    let row = db.inbox.outbox().get(first).await.unwrap().unwrap();
    assert!(row.sent && !row.dead && row.attempts == 1);
    db.cleanup().await;
}

async fn failures_are_retried_dead_lettered_and_replayed_with_the_same_key<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let flaky = enqueue(&db.inbox, "evt_1", "flaky").await;
    let refused = enqueue(&db.inbox, "evt_2", "refused").await;
    let sink = Recorder::answering([
        retry("503 Service Unavailable"),
        Delivered::Reject {
            reason: "400 Bad Request: no such customer".to_owned(),
        },
    ]);
    let outbox = db.inbox.outbox();
    let relay = outbox
        .relay()
        .options(eager())
        .destination("sink", sink.clone());

    let round = relay.relay_once().await.unwrap();
    assert_eq!((round.retried, round.dead), (1, 1));
    let round = relay.relay_once().await.unwrap();
    assert_eq!((round.taken, round.sent), (1, 1));

    let dead = outbox.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, refused);
    assert_eq!(
        dead[0].last_error.as_deref(),
        Some("400 Bad Request: no such customer")
    );
    assert_eq!(outbox.get(flaky).await.unwrap().unwrap().attempts, 2);

    assert!(outbox.replay(refused).await.unwrap());
    assert!(
        !outbox.replay(flaky).await.unwrap(),
        "a sent row is not a dead letter"
    );
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);
    let keys_of = |id| -> Vec<String> {
        sink.seen()
            .into_iter()
            .filter(|(row, _, _)| *row == id)
            .map(|(_, key, _)| key)
            .collect()
    };
    let refused_keys = keys_of(refused);
    assert_eq!(refused_keys.len(), 2);
    assert_eq!(
        refused_keys[0], refused_keys[1],
        "the replay sent another key"
    );
    assert_eq!(keys_of(flaky).len(), 2);
    assert!(outbox.dead_letters(10).await.unwrap().is_empty());
    db.cleanup().await;
}

async fn retries_stop_after_the_last_attempt<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = enqueue(&db.inbox, "evt_1", "down").await;
    let sink = Recorder::answering((0..10).map(|_| retry("connection refused")));
    let outbox = db.inbox.outbox();
    let relay = outbox
        .relay()
        .options(eager().max_attempts(3))
        .destination("sink", sink.clone());
    for expected in [(1, 0), (1, 0), (0, 1)] {
        let round = relay.relay_once().await.unwrap();
        assert_eq!((round.retried, round.dead), expected);
    }
    assert_eq!(relay.relay_once().await.unwrap(), RelayRound::default());
    let row = outbox.get(id).await.unwrap().unwrap();
    assert!(row.dead && row.attempts == 3);
    assert_eq!(row.last_error.as_deref(), Some("connection refused"));
    assert_eq!(outbox.replay_all().await.unwrap(), 1);
    assert_eq!(outbox.get(id).await.unwrap().unwrap().attempts, 0);
    db.cleanup().await;
}

async fn dead_letters_are_replayed_in_batches_oldest_first<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let mut ids = Vec::new();
    for n in 0..5 {
        ids.push(enqueue(&db.inbox, &format!("evt_{n}"), "refused").await);
    }
    let refusals = (0..5).map(|_| Delivered::Reject {
        reason: "410 Gone".to_owned(),
    });
    let outbox = db.inbox.outbox();
    let relay = outbox
        .relay()
        .options(eager())
        .destination("sink", Recorder::answering(refusals));
    assert_eq!(relay.relay_once().await.unwrap().dead, 5);
    let due = |outbox: &justonce_sql::Outbox<DB>| {
        let outbox = outbox.clone();
        async move {
            let dead = outbox.dead_letters(10).await.unwrap();
            dead.into_iter().map(|row| row.id).collect::<Vec<_>>()
        }
    };
    assert_eq!(outbox.replay_batch(2).await.unwrap(), 2);
    assert_eq!(due(&outbox).await, ids[2..], "the two oldest went first");
    assert_eq!(outbox.replay_batch(2).await.unwrap(), 2);
    assert_eq!(outbox.replay_batch(2).await.unwrap(), 1);
    assert_eq!(outbox.replay_batch(2).await.unwrap(), 0);
    assert!(due(&outbox).await.is_empty());
    assert_eq!(outbox.stats().await.unwrap().due, 5);
    db.cleanup().await;
}

/// The outbox's counts split by destination add up to its counts for all rows.
async fn stats_count_each_destination_apart<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    for (key, destination) in [("evt_1", "alpha"), ("evt_2", "alpha"), ("evt_3", "beta")] {
        let key = justonce_sql::Key::new(key).unwrap();
        db.inbox
            .run(&key, b"payload", |tx| {
                Box::pin(
                    db.inbox
                        .enqueue(tx, &key, "step", Message::new(destination, "payload")),
                )
            })
            .await
            .expect("run")
            .processed()
            .expect("a new key");
    }
    let outbox = db.inbox.outbox();
    let counts = |stats: &justonce_sql::OutboxStats| (stats.sent, stats.due, stats.dead);
    let by_destination = |outbox: justonce_sql::Outbox<DB>| async move {
        let stats = outbox.stats_by_destination().await.unwrap();
        stats
            .iter()
            .map(|(destination, stats)| (destination.clone(), counts(stats)))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        by_destination(outbox.clone()).await,
        [
            ("alpha".to_owned(), (0, 2, 0)),
            ("beta".to_owned(), (0, 1, 0))
        ]
    );
    let refusal = Delivered::Reject {
        reason: "410 Gone".to_owned(),
    };
    let round = outbox
        .relay()
        .options(eager())
        .destination("alpha", Recorder::default())
        .destination("beta", Recorder::answering([refusal]))
        .relay_once()
        .await
        .unwrap();
    assert_eq!((round.sent, round.dead), (2, 1));
    assert_eq!(
        by_destination(outbox.clone()).await,
        [
            ("alpha".to_owned(), (2, 0, 0)),
            ("beta".to_owned(), (0, 0, 1))
        ]
    );
    assert_eq!(counts(&outbox.stats().await.unwrap()), (2, 0, 1));
    db.cleanup().await;
}

/// A row for a destination this relay does not know may be for one a newer configuration
/// adds: it is retried, and dead-lettered only when its retries run out.
async fn a_row_for_an_unknown_destination_is_retried<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = enqueue(&db.inbox, "evt_1", "lost").await;
    let outbox = db.inbox.outbox();
    assert_eq!(
        outbox
            .relay()
            .options(eager())
            .relay_once()
            .await
            .unwrap()
            .retried,
        1
    );
    let row = outbox.get(id).await.unwrap().unwrap();
    assert!(
        row.last_error
            .unwrap()
            .contains("no destination named \"sink\"")
    );
    let last_try = outbox.relay().options(eager().max_attempts(2));
    assert_eq!(last_try.relay_once().await.unwrap().dead, 1);
    assert_eq!(outbox.purge_dead_letters().await.unwrap(), 1);
    assert!(outbox.get(id).await.unwrap().is_none());
    db.cleanup().await;
}

async fn sent_rows_are_purged_after_their_retention<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    for n in 0..7 {
        enqueue(&db.inbox, &format!("evt_{n}"), "email").await;
    }
    let outbox = db.inbox.outbox();
    let relay = outbox.relay().destination("sink", Recorder::default());
    assert_eq!(relay.relay_once().await.unwrap().sent, 7);
    let unsent = enqueue(&db.inbox, "evt_late", "email").await;
    assert_eq!(
        outbox
            .purge_sent(Duration::from_secs(3600), 3)
            .await
            .unwrap(),
        0
    );
    DB::age_rows(
        db.inbox.pool(),
        format!("{}outbox", db.prefix),
        "sent_at",
        7_200_000,
    )
    .await;
    assert_eq!(
        outbox
            .purge_sent(Duration::from_secs(3600), 3)
            .await
            .unwrap(),
        7
    );
    assert_eq!(db.rows("outbox").await, 1);
    assert!(outbox.get(unsent).await.unwrap().is_some());
    db.cleanup().await;
}

async fn offsets_never_move_backwards<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let inbox = &db.inbox;
    let commit = |partition, offset: Offset| async move {
        let mut tx = inbox.begin().await.unwrap();
        let moved = inbox
            .commit_offset(&mut tx, "orders", partition, offset)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        moved == OffsetCommit::Moved
    };
    assert!(commit(0, 5.into()).await);
    assert!(
        !commit(0, 3.into()).await,
        "an older offset moved the stored one back"
    );
    assert!(commit(0, 7.into()).await);
    assert!(commit(0, Offset::new(7, 1)).await);
    assert!(commit(1, 2.into()).await);
    assert_eq!(
        inbox.load_offsets("orders").await.unwrap(),
        vec![(0, Offset::new(7, 1)), (1, Offset::from(2))]
    );
    assert!(
        db.consumer("other")
            .load_offsets("orders")
            .await
            .unwrap()
            .is_empty()
    );

    // Concurrent commits in any order leave the highest.
    let tasks: Vec<_> = (0..16)
        .map(|n| {
            let inbox = inbox.clone();
            tokio::spawn(async move {
                let mut tx = inbox.begin().await.unwrap();
                let _ = inbox
                    .commit_offset(&mut tx, "orders", 2, Offset::from((n * 7) % 16))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let stored = inbox.load_offsets("orders").await.unwrap();
    assert_eq!(stored[2], (2, Offset::from(15)));

    // A batch's span moves the offset to its last entry only if none of its entries was
    // stored before: its first must be past the stored offset.
    let span = |first: i64, last: i64| async move {
        let mut tx = inbox.begin().await.unwrap();
        let moved = inbox
            .commit_offset_span(&mut tx, "orders", 3, first.into(), last.into())
            .await
            .unwrap();
        tx.commit().await.unwrap();
        moved == OffsetCommit::Moved
    };
    assert!(span(1, 10).await, "a first span on a partition");
    assert!(
        !span(10, 20).await,
        "a span whose first entry is the stored offset moved it"
    );
    assert!(
        !span(5, 30).await,
        "a span that overlaps the stored one moved it"
    );
    assert!(span(11, 20).await);
    assert_eq!(
        inbox.load_offsets("orders").await.unwrap()[3],
        (3, Offset::from(20))
    );

    // Offsets commit with the work, or not at all.
    let mut tx = inbox.begin().await.unwrap();
    let moved = inbox
        .commit_offset(&mut tx, "orders", 0, 99.into())
        .await
        .unwrap();
    assert_eq!(moved, OffsetCommit::Moved);
    tx.rollback().await.unwrap();
    assert_eq!(
        inbox.load_offsets("orders").await.unwrap()[0].1,
        Offset::new(7, 1)
    );
    db.cleanup().await;
}

/// A batch read from a stream moves the offset of each of its partitions in its own
/// transaction: all of them with its keys and effects, or, when a stored offset is at or
/// past a span's first entry, none of them and nothing else.
async fn a_batch_moves_its_partitions_offsets_with_its_work_or_not_at_all<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let inbox = &db.inbox;
    let prefix = db.prefix.as_str();
    let span = |partition, first: i64, last: i64| OffsetSpan {
        stream: "orders",
        partition,
        first: first.into(),
        last: last.into(),
    };
    let run = |names: &'static [&'static str], spans: Vec<OffsetSpan<'static>>| async move {
        let keys: Vec<justonce_sql::Key> = names.iter().map(|name| key(name)).collect();
        inbox
            .run_batch_at_offsets(
                &keys,
                |key| (key, key.as_str().as_bytes()),
                &spans,
                |tx, firsts| {
                    let firsts: Vec<&str> = firsts.iter().map(|key| key.as_str()).collect();
                    Box::pin(async move { DB::insert_effects(tx, prefix, "test", &firsts).await })
                },
            )
            .await
            .unwrap()
    };

    let first = run(&["a", "b", "c"], vec![span(0, 1, 2), span(1, 1, 1)]).await;
    assert_eq!(first, Some(vec![Outcome::Processed(()); 3]));
    assert_eq!(
        inbox.load_offsets("orders").await.unwrap(),
        vec![(0, Offset::from(2)), (1, Offset::from(1))]
    );

    // Partition 1 is past this span's first entry: nothing commits, on partition 0 either.
    let passed = run(&["d", "e"], vec![span(0, 3, 3), span(1, 1, 2)]).await;
    assert_eq!(passed, None);
    assert_eq!(
        inbox.load_offsets("orders").await.unwrap(),
        vec![(0, Offset::from(2)), (1, Offset::from(1))]
    );
    assert_eq!(db.rows("keys").await, 3, "the passed batch claimed nothing");
    assert_eq!(
        db.rows("effects").await,
        3,
        "the passed batch wrote nothing"
    );

    // Past the stored offsets, with a key claimed before: a duplicate, and both move.
    let next = run(&["a", "d"], vec![span(0, 3, 3), span(1, 2, 2)]).await;
    assert_eq!(next, Some(vec![Outcome::Duplicate, Outcome::Processed(())]));
    assert_eq!(
        inbox.load_offsets("orders").await.unwrap(),
        vec![(0, Offset::from(3)), (1, Offset::from(2))]
    );
    assert_eq!(db.rows("effects").await, 4);
    db.cleanup().await;
}

/// A batch run after another (`run_batch_after`) moves its offsets only from where that
/// one moves them: while that one's transaction is open, it waits for it; if that one
/// rolled back, it commits nothing, neither its keys nor its work. After a commit it moves
/// on; a stored offset at or past its first entry stops it too.
async fn a_batch_after_another_commits_only_once_that_one_did<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let inbox = &db.inbox;
    let prefix = db.prefix.as_str();
    let span = |first: i64, last: i64| OffsetSpan {
        stream: "orders",
        partition: 0,
        first: first.into(),
        last: last.into(),
    };
    let keys =
        |names: &[&str]| -> Vec<justonce_sql::Key> { names.iter().map(|name| key(name)).collect() };
    let run_at = |names: Vec<justonce_sql::Key>, span: OffsetSpan<'static>| async move {
        inbox
            .run_batch_at_offsets(
                &names,
                |key| (key, key.as_str().as_bytes()),
                &[span],
                |tx, firsts| {
                    let firsts: Vec<&str> = firsts.iter().map(|key| key.as_str()).collect();
                    Box::pin(async move { DB::insert_effects(tx, prefix, "test", &firsts).await })
                },
            )
            .await
            .unwrap()
    };
    let run_after = |names: Vec<justonce_sql::Key>,
                     span: OffsetSpan<'static>,
                     before: OffsetSpan<'static>| async move {
        inbox
            .run_batch_after(
                &names,
                |key| (key, key.as_str().as_bytes()),
                &[span],
                &[before],
                |tx, firsts| {
                    let firsts: Vec<&str> = firsts.iter().map(|key| key.as_str()).collect();
                    Box::pin(async move { DB::insert_effects(tx, prefix, "test", &firsts).await })
                },
            )
            .await
            .unwrap()
    };

    // The first batch ever, then one after it.
    assert_eq!(
        run_at(keys(&["a"]), span(1, 1)).await,
        Some(vec![Outcome::Processed(())])
    );
    let after = run_after(keys(&["b", "c"]), span(2, 3), span(1, 1)).await;
    assert_eq!(after, Some(vec![Outcome::Processed(()); 2]));
    assert_eq!(
        inbox.load_offsets("orders").await.unwrap(),
        vec![(0, Offset::from(3))]
    );

    // The batch before (4 to 5) still open: the batch after waits for its end, and moves
    // only if it committed.
    for commits in [false, true] {
        let mut before = inbox.begin().await.unwrap();
        let moved = inbox.commit_offset_span(&mut before, "orders", 0, 4.into(), 5.into());
        assert_eq!(moved.await.unwrap(), OffsetCommit::Moved);
        let end_before = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            match commits {
                true => before.commit().await.unwrap(),
                false => before.rollback().await.unwrap(),
            }
        };
        let (after, ()) = tokio::join!(
            run_after(keys(&["d", "e"]), span(6, 7), span(4, 5)),
            end_before
        );
        let (outcome, stored, rows) = match commits {
            true => (Some(vec![Outcome::Processed(()); 2]), 7, 5),
            false => (None, 3, 3),
        };
        assert_eq!(after, outcome, "the batch before committed: {commits}");
        assert_eq!(
            inbox.load_offsets("orders").await.unwrap(),
            vec![(0, Offset::from(stored))]
        );
        assert_eq!(db.rows("keys").await, rows, "keys of the batch after");
        assert_eq!(db.rows("effects").await, rows, "effects of the batch after");
    }

    // A stored offset at this batch's first: nothing commits either.
    let passed = run_after(keys(&["f"]), span(7, 8), span(6, 7)).await;
    assert_eq!(passed, None, "the stored offset is past the span's first");
    assert_eq!(db.rows("keys").await, 5);
    db.cleanup().await;
}

/// A slow transaction commits its row after a faster one with a higher id: the relay still
/// sends it, because it takes due rows rather than reading past the highest id it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_committed_after_a_later_one_is_not_skipped_on_postgres() {
    let db = TestDb::<sqlx::Postgres>::new("late").await;
    let sink = Recorder::default();
    let relay = db.inbox.outbox().relay().destination("sink", sink.clone());
    let (early, late) = (key("early"), key("late"));

    let mut slow = db.inbox.begin().await.unwrap();
    let slow_id = db
        .inbox
        .enqueue(&mut slow, &early, "s", Message::new("sink", "slow"))
        .await
        .unwrap();
    let mut fast = db.inbox.begin().await.unwrap();
    let fast_id = db
        .inbox
        .enqueue(&mut fast, &late, "s", Message::new("sink", "fast"))
        .await
        .unwrap();
    assert!(slow_id < fast_id);
    fast.commit().await.unwrap();
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);
    slow.commit().await.unwrap();
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);
    let sent: Vec<i64> = sink.seen().iter().map(|(id, _, _)| *id).collect();
    assert_eq!(sent, vec![fast_id, slow_id]);
    db.cleanup().await;
}

/// A committed row wakes a waiting relay through LISTEN/NOTIFY, long before its poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_row_wakes_the_relay_on_postgres() {
    let db = TestDb::<sqlx::Postgres>::new("wake").await;
    let sink = Recorder::default();
    let running = waiting_relay(&db.inbox, &sink).await;
    enqueue(&db.inbox, "evt_1", "email").await;
    wait_for_deliveries(&sink, 2).await;
    running.stop().await;
    db.cleanup().await;
}

/// A relay that polls only every ten minutes, so that a row reaches it in time only by a
/// wake-up or in a round that is already under way; returned once its first round has
/// delivered a row committed before it started. It listens, and watches this process's
/// commits, before that round. A row committed while the relay still goes on from its
/// first delivery (it takes rows again after each delivery) may be taken without a wake:
/// these tests show that no row waits for the poll, not which of the two took it.
async fn waiting_relay<DB: TestBackend>(inbox: &Inbox<DB>, sink: &Recorder) -> RunningRelay {
    enqueue(inbox, "shop:before", "first round").await;
    let relay = inbox
        .outbox()
        .relay()
        .options(RelayOptions::default().poll_interval(Duration::from_secs(600)))
        .destination("sink", sink.clone());
    let running = RunningRelay::start(relay);
    wait_for_deliveries(sink, 1).await;
    running
}

/// Waits until `sink` has seen `count` deliveries; fails after 30 s, far past any poll but
/// the ten-minute one of [`waiting_relay`].
async fn wait_for_deliveries(sink: &Recorder, count: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while sink.seen().len() < count {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay was not woken: {} of {count} rows delivered",
            sink.seen().len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How a test forwards its events: as the webhook receiver does ([`Inbox::run_forward`]),
/// as a consumer does one at a time ([`Inbox::forward`] in the work of [`Inbox::run`]), or
/// a batch at a time (in the work of [`Inbox::run_batch_at_once`]).
#[derive(Debug, Clone, Copy)]
enum Forwarding {
    RunForward,
    InRun,
    InBatch,
}

const FORWARDINGS: [Forwarding; 3] = [
    Forwarding::RunForward,
    Forwarding::InRun,
    Forwarding::InBatch,
];

/// Forwards `events` distinct events through `inbox` at once (batches of 10 at once for
/// [`Forwarding::InBatch`]), each to be processed; their ids begin with `prefix`.
async fn forward_at_once<DB: TestBackend>(
    inbox: &Inbox<DB>,
    how: Forwarding,
    prefix: &str,
    events: usize,
) {
    let keys: Vec<_> = (0..events)
        .map(|n| key(&format!("shop:{prefix}_{n}")))
        .collect();
    let runs = keys.chunks(10).map(|chunk| {
        let (inbox, chunk) = (inbox.clone(), chunk.to_vec());
        tokio::spawn(async move {
            let message = |key: &justonce_sql::Key| Message::new("sink", key.as_str().to_owned());
            let outcomes = match how {
                Forwarding::InBatch => inbox
                    .run_batch_at_once(
                        &chunk,
                        |key| (key, key.as_str().as_bytes()),
                        |tx, firsts| {
                            let inbox = inbox.clone();
                            Box::pin(async move {
                                for key in firsts {
                                    inbox.forward(tx, key, message(key)).await?;
                                }
                                Ok::<_, justonce_sql::Error>(())
                            })
                        },
                    )
                    .await
                    .unwrap(),
                Forwarding::RunForward | Forwarding::InRun => {
                    let runs = chunk.iter().map(|key| {
                        let inbox = inbox.clone();
                        async move {
                            let payload = key.as_str().as_bytes();
                            match how {
                                Forwarding::RunForward => {
                                    inbox.run_forward(key, payload, message(key)).await.unwrap()
                                }
                                _ => inbox
                                    .run(key, payload, |tx| {
                                        let forward = inbox.forward(tx, key, message(key));
                                        Box::pin(async move { forward.await.map(drop) })
                                    })
                                    .await
                                    .unwrap(),
                            }
                        }
                    });
                    futures_util::future::join_all(runs).await
                }
            };
            assert!(
                outcomes.iter().all(|o| *o == Outcome::Processed(())),
                "{how:?}: {outcomes:?}"
            );
        })
    });
    for run in futures_util::future::join_all(runs).await {
        run.unwrap();
    }
}

/// A row forwarded by `run_forward`, or by `forward` in a run's or a batch's work, wakes
/// its own process's relay as soon as it is committed, on every database: SQLite and
/// MariaDB have no notifications at all.
async fn a_forwarded_row_wakes_the_relay_of_its_process<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let sink = Recorder::default();
    let running = waiting_relay(&db.inbox, &sink).await;
    for (done, how) in FORWARDINGS.into_iter().enumerate() {
        forward_at_once(&db.inbox, how, &format!("{how:?}"), 1).await;
        wait_for_deliveries(&sink, 1 + done + 1).await;
    }
    running.stop().await;
    db.cleanup().await;
}

/// Rows forwarded by one process are delivered by a relay in another: the forwarding
/// statements inside runs send no NOTIFY, so only the one sent after their commits can
/// wake that relay. A burst: the rows committed after the first notification need the
/// next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_rows_wake_a_relay_in_another_process_on_postgres() {
    let db = TestDb::<sqlx::Postgres>::new("wake-other").await;
    let elsewhere = TestDb::<sqlx::Postgres>::reopen(&db.url, &db.prefix).await;
    let sink = Recorder::default();
    let running = waiting_relay(&elsewhere.inbox, &sink).await;
    for (done, how) in FORWARDINGS.into_iter().enumerate() {
        forward_at_once(&db.inbox, how, &format!("{how:?}"), 50).await;
        wait_for_deliveries(&sink, 1 + 50 * (done + 1)).await;
    }
    running.stop().await;
    db.cleanup().await;
}

/// A row forwarded in a transaction of the caller's own, which justonce does not commit,
/// still wakes a relay in another process: its NOTIFY goes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_forwarded_in_a_transaction_of_ones_own_wakes_a_relay_elsewhere_on_postgres() {
    let db = TestDb::<sqlx::Postgres>::new("wake-own").await;
    let elsewhere = TestDb::<sqlx::Postgres>::reopen(&db.url, &db.prefix).await;
    let sink = Recorder::default();
    let running = waiting_relay(&elsewhere.inbox, &sink).await;
    let mut tx = db.inbox.begin().await.unwrap();
    let key = key("shop:own");
    (db.inbox)
        .forward(&mut tx, &key, Message::new("sink", "own"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    wait_for_deliveries(&sink, 2).await;
    running.stop().await;
    db.cleanup().await;
}

/// A burst of forwarded rows is announced to other processes by far fewer notifications
/// than rows, however they are forwarded: one at the first commit, then at most one per
/// `notify_every` (here a minute, longer than the bursts take). A NOTIFY in each
/// transaction would send one per commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_forwarded_rows_sends_few_notifications_on_postgres() {
    const EVENTS: usize = 200;
    let db = TestDb::<sqlx::Postgres>::new("notify-burst").await;
    let channel = format!("{}outbox", db.prefix);
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener.listen(&channel).await.unwrap();
    let options = InboxOptions::default()
        .prefix(&db.prefix)
        .notify_every(Duration::from_secs(60));
    let inbox =
        Inbox::<sqlx::Postgres>::connect_with(&db.url, Consumer::new("test").unwrap(), options)
            .await
            .unwrap();
    for how in FORWARDINGS {
        forward_at_once(&inbox, how, &format!("{how:?}"), EVENTS).await;
    }
    assert_eq!(db.rows("outbox").await, (3 * EVENTS) as i64);
    // Notifications reach a listener in commit order: this one marks the bursts' end.
    sqlx::query("SELECT pg_notify($1, 'end')")
        .bind(&channel)
        .execute(db.inbox.pool())
        .await
        .unwrap();
    let (mut notified, mut ended) = (0, false);
    while !ended || notified == 0 {
        match listener.recv().await.unwrap().payload() {
            "end" => ended = true,
            _ => notified += 1,
        }
    }
    assert!(
        notified <= 2,
        "{notified} notifications for {} forwarded rows",
        3 * EVENTS
    );
    db.cleanup().await;
}

/// Two relays on one database share the rows: every row is sent, and a row sent twice
/// (after a lease ran out) carries the same key both times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_share_the_rows_on_postgres() {
    let db = TestDb::<sqlx::Postgres>::new("share").await;
    for n in 0..300 {
        enqueue(&db.inbox, &format!("evt_{n}"), "email").await;
    }
    let sink = Recorder::default();
    let relays: Vec<_> = (0..2)
        .map(|_| {
            let relay = db
                .inbox
                .outbox()
                .relay()
                .options(RelayOptions::default().batch_size(10))
                .destination("sink", sink.clone());
            tokio::spawn(async move {
                let mut sent = 0;
                loop {
                    let round = relay.relay_once().await.unwrap();
                    if round.taken == 0 {
                        return sent;
                    }
                    sent += round.sent;
                }
            })
        })
        .collect();
    let mut per_relay = Vec::new();
    for relay in relays {
        per_relay.push(relay.await.unwrap());
    }
    assert_eq!(per_relay.iter().sum::<usize>(), 300);
    let seen = sink.seen();
    let mut keys_by_row = std::collections::HashMap::<i64, Vec<String>>::new();
    for (id, key, _) in seen {
        keys_by_row.entry(id).or_default().push(key);
    }
    assert_eq!(keys_by_row.len(), 300);
    assert!(
        keys_by_row
            .values()
            .all(|keys| keys.iter().all(|k| *k == keys[0]))
    );
    let due = sqlx::query_as::<_, (i64,)>(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}outbox WHERE sent_at IS NULL",
        db.prefix
    )))
    .fetch_one(db.inbox.pool())
    .await
    .unwrap();
    assert_eq!(due.0, 0);
    println!("rows sent per relay: {per_relay:?}");
    db.cleanup().await;
}

/// A single reader killed with SIGKILL again and again resumes after its stored offset:
/// every entry has exactly one effect.
async fn a_killed_reader_resumes_at_its_stored_offset<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let entries = 600;
    let reader = || {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_stream-worker"))
            .args([&db.url, &db.prefix, &entries.to_string()])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start stream-worker")
    };
    for round in 0..8 {
        let mut killed = reader();
        tokio::time::sleep(Duration::from_millis(40 + 25 * round)).await;
        killed.kill().await.expect("SIGKILL the reader");
    }
    let output = tokio::time::timeout(Duration::from_secs(300), reader().wait_with_output())
        .await
        .expect("the reader hung")
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "done");
    let distinct = DB::count(
        db.inbox.pool(),
        format!("SELECT count(DISTINCT msg_key) FROM {}effects", db.prefix),
    )
    .await;
    assert_eq!((db.rows("effects").await, distinct), (entries, entries));
    let stored = db.consumer("stream").load_offsets("orders").await.unwrap();
    assert_eq!(stored, vec![(0, Offset::from(entries - 1))]);
    db.cleanup().await;
}

async fn a_row_past_its_delivery_window_is_dead_lettered<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let id = enqueue(&db.inbox, "evt_1", "late").await;
    DB::age_rows(
        db.inbox.pool(),
        format!("{}outbox", db.prefix),
        "created_at",
        7_200_000,
    )
    .await;
    let outbox = db.inbox.outbox();
    let lenient = outbox
        .relay()
        .options(eager())
        .destination("sink", Recorder::answering([retry("503")]));
    assert_eq!(
        lenient.relay_once().await.unwrap().retried,
        1,
        "3 days by default"
    );
    let strict = outbox.relay().options(eager()).destination_for(
        "sink",
        Recorder::answering([retry("503")]),
        Duration::from_secs(3600),
    );
    assert_eq!(strict.relay_once().await.unwrap().dead, 1);
    assert!(outbox.get(id).await.unwrap().unwrap().dead);
    db.cleanup().await;
}

/// `run_forward`: the claim and one row forwarding the message with its own key, together;
/// the same key again writes nothing, whether its payload is the same or not.
async fn run_forward_writes_one_row_with_the_key_and_skips_what_was_seen<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let event = key("shop:evt_1");
    let message = || Message::new("sink", b"evt body".to_vec());
    let first = db.inbox.run_forward(&event, b"evt body", message()).await;
    assert_eq!(first.unwrap(), Outcome::Processed(()));
    // Another process knows nothing of this one's recent keys: the database answers.
    let other = TestDb::<DB>::reopen(&db.url, &db.prefix).await;
    let again = other
        .inbox
        .run_forward(&event, b"evt body", message())
        .await;
    assert_eq!(again.unwrap(), Outcome::Duplicate);
    let reused = other
        .inbox
        .run_forward(&event, b"other body", message())
        .await;
    assert!(matches!(reused.unwrap(), Outcome::KeyReused { .. }));
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (1, 1));

    let sink = Recorder::default();
    let relay = db.inbox.outbox().relay().destination("sink", sink.clone());
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);
    let seen: Vec<(String, Vec<u8>)> = sink.seen().into_iter().map(|(_, k, p)| (k, p)).collect();
    assert_eq!(seen, vec![("shop:evt_1".to_owned(), b"evt body".to_vec())]);
    db.cleanup().await;
}

/// Sixteen tasks forward the same key at once: one writes its row, the others are told
/// it is a duplicate.
async fn run_forward_racing_on_one_key_writes_one_row<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let runs = (0..16).map(|_| {
        let inbox = db.inbox.clone();
        tokio::spawn(async move {
            let message = Message::new("sink", b"evt".to_vec());
            inbox.run_forward(&key("shop:evt_2"), b"evt", message).await
        })
    });
    let mut processed = 0;
    for run in futures_util::future::join_all(runs).await {
        match run.unwrap().unwrap() {
            Outcome::Processed(()) => processed += 1,
            Outcome::Duplicate => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(processed, 1);
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (1, 1));
    db.cleanup().await;
}
