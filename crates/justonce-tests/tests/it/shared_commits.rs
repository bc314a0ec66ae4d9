//! `InboxOptions::share_commits`: concurrent `run_forward` calls share transactions, and
//! each still gets its own outcome, with each effect (the forwarding outbox row) once.

use super::{key, on_every_database};
use justonce_sql::{Consumer, Fingerprint, Inbox, InboxOptions, Key, Message, Outcome, Scope};
use justonce_tests::{TestBackend, TestDb};

on_every_database!(
    concurrent_forwards_sharing_commits_each_take_effect_once,
    a_failing_call_does_not_fail_the_others_of_its_shared_commit,
    one_shared_commit_answers_each_call_as_a_commit_of_its_own_would,
);

/// A second inbox on the test's tables that shares commits, with few connections (one group
/// commits per two), so that calls queue and form groups, and without recent keys, so that
/// the database judges every duplicate.
async fn sharing<DB: TestBackend>(db: &TestDb<DB>, connections: u32) -> Inbox<DB> {
    let options = InboxOptions::default()
        .prefix(&db.prefix)
        .pool_size(connections)
        .recent_keys(0)
        .share_commits(true);
    Inbox::<DB>::connect_with(&db.url, db.inbox.consumer().clone(), options)
        .await
        .expect("connect")
}

/// Forwards each `(key, body)` at once, and returns the outcomes in order.
async fn forward_all<DB: TestBackend>(
    inbox: &Inbox<DB>,
    calls: &[(String, String)],
) -> Vec<Outcome<()>> {
    let runs = calls.iter().cloned().map(|(name, body)| {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            let message = Message::new("sink", body.clone().into_bytes());
            inbox
                .run_forward(&key(&name), body.as_bytes(), message)
                .await
        })
    });
    futures_util::future::join_all(runs)
        .await
        .into_iter()
        .map(|run| run.unwrap().expect("stored"))
        .collect()
}

/// 300 calls at once: 200 events, 60 of them sent twice in the same burst (so within a
/// group or in groups committing side by side), one sent again with another body; then a
/// second burst repeating 100 of them, in later groups. Each event is processed once,
/// every repeat is a duplicate, the reuse is reported, and each event has one key row and
/// one outbox row, holding the body of the call that was processed.
async fn concurrent_forwards_sharing_commits_each_take_effect_once<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let inbox = sharing(&db, 4).await;
    let event = |n: usize| (format!("shop:evt_{n}"), format!("body {n}"));
    let mut burst: Vec<(String, String)> = (0..200).map(event).collect();
    burst.extend((0..60).map(|n| event(n * 3)));
    burst.push((format!("shop:evt_{}", 7), "another body".to_owned()));
    burst.extend((0..39).map(|n| event(n * 5 + 1)));
    let outcomes = forward_all(&inbox, &burst).await;
    let processed = |outcomes: &[Outcome<()>]| {
        outcomes
            .iter()
            .filter(|outcome| matches!(outcome, Outcome::Processed(())))
            .count()
    };
    let reused: Vec<&(String, String)> = burst
        .iter()
        .zip(&outcomes)
        .filter(|(_, outcome)| matches!(outcome, Outcome::KeyReused { .. }))
        .map(|(call, _)| call)
        .collect();
    assert_eq!(processed(&outcomes), 200, "each event processed once");
    assert_eq!(reused.len(), 1, "the reused key is reported once");
    assert_eq!(reused[0].0, "shop:evt_7");
    let duplicates = outcomes.len() - 200 - 1;
    assert_eq!(
        outcomes
            .iter()
            .filter(|outcome| matches!(outcome, Outcome::Duplicate))
            .count(),
        duplicates
    );
    // The processed call of evt_7 is the one whose body is stored.
    let evt_7_processed = burst
        .iter()
        .zip(&outcomes)
        .find(|((name, _), outcome)| {
            name == "shop:evt_7" && matches!(outcome, Outcome::Processed(()))
        })
        .map(|((_, body), _)| body.clone().into_bytes());
    let outbox = db.inbox.outbox();
    let ids = outbox.ids_with_key("shop:evt_7").await.unwrap();
    assert_eq!(ids.len(), 1);
    let row = outbox.get(ids[0]).await.unwrap().expect("the row");
    assert_eq!(Some(row.payload), evt_7_processed);
    // Each row holds its own call's body: the group pairs rows with their calls.
    for n in (0..200).filter(|n| *n != 7) {
        let name = format!("shop:evt_{n}");
        let ids = outbox.ids_with_key(&name).await.unwrap();
        assert_eq!(ids.len(), 1, "{name}");
        let row = outbox.get(ids[0]).await.unwrap().expect("the row");
        assert_eq!(row.payload, format!("body {n}").into_bytes(), "{name}");
    }
    let again: Vec<(String, String)> = (0..100).map(|n| event(n * 2)).collect();
    let outcomes = forward_all(&inbox, &again).await;
    assert!(
        outcomes
            .iter()
            .all(|outcome| *outcome == Outcome::Duplicate),
        "{outcomes:?}"
    );
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (200, 200));
    assert_eq!(outbox_keys_written_twice(&db).await, 0);
    // Groups claimed the keys: keys share claim ids, where calls committed one by one would
    // carry 200. Not a bound of a few: on MariaDB two groups in flight can deadlock, and
    // the one that loses runs its calls one by one.
    let names: Vec<String> = (0..200).map(|n| event(n).0).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let claim_ids = claim_ids_of(&db, &names).await;
    assert!(claim_ids < 200, "{claim_ids} claim ids for 200 keys");
    inbox.pool().close().await;
    db.cleanup().await;
}

/// Polls `call` once, then lets it run on in a task of its own. A `run_forward` of an inbox
/// that shares commits joins the commit queue before it first waits, so the calls started
/// one after another here are queued in that order when this returns: no sleep guesses
/// when they are.
fn queued<F>(call: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let mut call = Box::pin(call);
    let waker = std::task::Waker::noop();
    let first = call
        .as_mut()
        .poll(&mut std::task::Context::from_waker(waker));
    assert!(first.is_pending(), "a call answered before its commit");
    tokio::spawn(call)
}

/// Outbox keys that have more than one row.
async fn outbox_keys_written_twice<DB: TestBackend>(db: &TestDb<DB>) -> i64 {
    DB::count(
        db.inbox.pool(),
        format!(
            "SELECT count(*) FROM (SELECT {key} FROM {}outbox GROUP BY {key} HAVING count(*) > 1) d",
            db.prefix,
            key = DB::quoted("key")
        ),
    )
    .await
}

/// How many claim ids the key rows of `names` carry. A shared commit gives each key it
/// claims the group's one claim id; a call committed alone draws a random one of its own.
async fn claim_ids_of<DB: TestBackend>(db: &TestDb<DB>, names: &[&str]) -> i64 {
    let names: Vec<String> = names.iter().map(|name| format!("'{name}'")).collect();
    DB::count(
        db.inbox.pool(),
        format!(
            "SELECT count(DISTINCT claim_id) FROM {}keys WHERE {} IN ({})",
            db.prefix,
            DB::quoted("key"),
            names.join(", ")
        ),
    )
    .await
}

/// The database refuses outbox rows for the destination `refused` (a trigger), so a
/// shared commit holding such a call fails whole. A blocker holds the first commit back
/// while the calls queue behind it, so that they form one group with the refused call in
/// it. That call fails; every other call of its group is stored, once.
async fn a_failing_call_does_not_fail_the_others_of_its_shared_commit<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let prefix = &db.prefix;
    let trigger = match <DB as sqlx::Database>::NAME {
        "PostgreSQL" => format!(
            "CREATE FUNCTION {prefix}refuse() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                IF NEW.destination = 'refused' THEN RAISE EXCEPTION 'refused'; END IF;
                RETURN NEW;
             END $$;
             CREATE TRIGGER {prefix}refuse BEFORE INSERT ON {prefix}outbox
             FOR EACH ROW EXECUTE FUNCTION {prefix}refuse()"
        ),
        "MySQL" => format!(
            "CREATE TRIGGER {prefix}refuse BEFORE INSERT ON {prefix}outbox FOR EACH ROW
             IF NEW.destination = 'refused' THEN
                SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused';
             END IF"
        ),
        _ => format!(
            "CREATE TRIGGER {prefix}refuse BEFORE INSERT ON {prefix}outbox
             WHEN NEW.destination = 'refused'
             BEGIN SELECT RAISE(ABORT, 'refused'); END"
        ),
    };
    DB::execute(db.inbox.pool(), trigger)
        .await
        .expect("create the trigger");
    let inbox = sharing(&db, 2).await;
    // The blocker: another pool's transaction holding the key `shop:block` (and, on
    // SQLite, the write lock), so that the first group waits.
    let blocker = TestDb::<DB>::reopen(&db.url, prefix).await;
    let mut held = blocker.inbox.begin().await.unwrap();
    let block = key("shop:block");
    let _ = blocker
        .inbox
        .claim(&mut held, &block, b"block")
        .await
        .unwrap();
    // The first call takes the one group allowed in flight, which waits for the blocker;
    // each of the 40 then joins the queue behind it, so that they form the next group.
    let first = {
        let inbox = inbox.clone();
        queued(async move {
            let message = Message::new("sink", b"block".to_vec());
            inbox.run_forward(&block, b"block", message).await
        })
    };
    let calls: Vec<_> = (0..40)
        .map(|n| {
            let inbox = inbox.clone();
            queued(async move {
                let destination = if n == 13 { "refused" } else { "sink" };
                let body = format!("body {n}");
                let message = Message::new(destination, body.clone().into_bytes());
                let key: Key = key(&format!("shop:evt_{n}"));
                inbox.run_forward(&key, body.as_bytes(), message).await
            })
        })
        .collect();
    held.rollback().await.unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Processed(()));
    for (n, call) in futures_util::future::join_all(calls)
        .await
        .into_iter()
        .enumerate()
    {
        let outcome = call.unwrap();
        if n == 13 {
            assert!(outcome.is_err(), "the refused call failed: {outcome:?}");
        } else {
            assert_eq!(outcome.unwrap(), Outcome::Processed(()), "call {n}");
        }
    }
    // The blocker's event and 39 of the 40: the refused call left no key and no row.
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (40, 40));
    assert_eq!(outbox_keys_written_twice(&db).await, 0);
    blocker.inbox.pool().close().await;
    inbox.pool().close().await;
    if <DB as sqlx::Database>::NAME == "PostgreSQL" {
        DB::execute(
            db.inbox.pool(),
            format!("DROP TABLE {prefix}outbox; DROP FUNCTION {prefix}refuse()"),
        )
        .await
        .expect("drop the trigger's function");
    }
    db.cleanup().await;
}

/// One shared commit holding a key twice with one body, a key twice with two bodies, two
/// keys stored before (one with another body), and one key in another scope and for
/// another consumer. A blocker holds the first commit back while the calls queue one after
/// the other, so that they form one group in that order. Each call gets what a commit of
/// its own would have given it: the first call of a key claims it, a later one is a
/// duplicate or a key reuse of the first's body, a stored key is judged against its row.
async fn one_shared_commit_answers_each_call_as_a_commit_of_its_own_would<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let inbox = sharing(&db, 2).await;
    let forward = |inbox: Inbox<DB>, name: &'static str, body: &'static str| async move {
        let message = Message::new("sink", body.as_bytes().to_vec());
        inbox
            .run_forward(&key(name), body.as_bytes(), message)
            .await
    };
    for (name, body) in [("shop:stored", "stored"), ("shop:other", "first body")] {
        let stored = forward(inbox.clone(), name, body).await;
        assert_eq!(stored.unwrap(), Outcome::Processed(()));
    }
    let blocker = TestDb::<DB>::reopen(&db.url, &db.prefix).await;
    let mut held = blocker.inbox.begin().await.unwrap();
    let _ = (blocker.inbox.claim(&mut held, &key("shop:block"), b"block"))
        .await
        .unwrap();
    let first = queued(forward(inbox.clone(), "shop:block", "block"));
    let tenant = inbox.with_scope(Scope::new("tenant").unwrap());
    let other_consumer = inbox.with_consumer(Consumer::new("other").unwrap());
    let reused = |stored: &str, received: &str| Outcome::KeyReused {
        stored: Fingerprint::of(stored),
        received: Fingerprint::of(received),
    };
    let expected = [
        (&inbox, "shop:a", "body a", Outcome::Processed(())),
        (&inbox, "shop:a", "body a", Outcome::Duplicate),
        (&inbox, "shop:b", "body b", Outcome::Processed(())),
        (&inbox, "shop:b", "another b", reused("body b", "another b")),
        (&inbox, "shop:stored", "stored", Outcome::Duplicate),
        (
            &inbox,
            "shop:other",
            "second body",
            reused("first body", "second body"),
        ),
        (&tenant, "shop:a", "tenant a", Outcome::Processed(())),
        (&other_consumer, "shop:a", "other a", Outcome::Processed(())),
    ];
    let mut calls = Vec::new();
    for (inbox, name, body, _) in &expected {
        // Each call joins the queue before the next: the group holds them in this order.
        calls.push(queued(forward((*inbox).clone(), name, body)));
    }
    held.rollback().await.unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Processed(()));
    let outcomes: Vec<Outcome<()>> = futures_util::future::join_all(calls)
        .await
        .into_iter()
        .map(|call| call.unwrap().expect("stored"))
        .collect();
    let wanted: Vec<Outcome<()>> = expected.iter().map(|call| call.3.clone()).collect();
    assert_eq!(outcomes, wanted);
    // One row for each processed call, holding that call's body.
    let outbox = db.inbox.outbox();
    for (name, bodies) in [
        ("shop:a", vec!["body a", "other a", "tenant a"]),
        ("shop:b", vec!["body b"]),
        ("shop:other", vec!["first body"]),
    ] {
        let mut stored = Vec::new();
        for id in outbox.ids_with_key(name).await.unwrap() {
            let row = outbox.get(id).await.unwrap().expect("the row");
            stored.push(String::from_utf8(row.payload).unwrap());
        }
        stored.sort();
        assert_eq!(stored, bodies, "{name}");
    }
    assert_eq!((db.rows("keys").await, db.rows("outbox").await), (7, 7));
    // The four keys the group claimed carry its one claim id: the group committed as one,
    // not call by call.
    assert_eq!(claim_ids_of(&db, &["shop:a", "shop:b"]).await, 1);
    blocker.inbox.pool().close().await;
    inbox.pool().close().await;
    db.cleanup().await;
}
