//! `Inbox::record_run`: the runs of a key a consumer started, counted in their own commit,
//! apart for each scope and consumer, exact under concurrent counts, purged with the keys
//! once their last run is past the cutoff, and forgotten for a dead letter.
//! `Inbox::record_first_runs`: a batch's first runs counted in one statement, only while
//! none of its keys has runs counted.

use super::{key, on_every_database};
use justonce_sql::Scope;
use justonce_tests::{TestBackend, TestDb};
use std::time::Duration;

on_every_database!(
    each_run_started_adds_one_to_its_keys_count,
    first_runs_are_counted_together_only_while_none_of_the_keys_has_a_count,
);

const DAY_MS: i64 = 86_400_000;

async fn each_run_started_adds_one_to_its_keys_count<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    for expected in 1..=3 {
        assert_eq!(
            db.inbox.record_run(&key("order:1")).await.unwrap(),
            expected
        );
    }
    // A first count after others on the same connections starts at 1.
    assert_eq!(db.inbox.record_run(&key("order:2")).await.unwrap(), 1);
    let tenant = db.inbox.with_scope(Scope::new("acme").unwrap());
    assert_eq!(tenant.record_run(&key("order:1")).await.unwrap(), 1);
    let audit = db.consumer("audit");
    assert_eq!(audit.record_run(&key("order:1")).await.unwrap(), 1);
    assert_eq!(db.inbox.record_run(&key("order:1")).await.unwrap(), 4);
    assert_eq!(db.rows("runs").await, 4);
    // Nothing but the count: no key is claimed.
    assert_eq!(db.rows("keys").await, 0);

    let counting = (0..10).map(|_| {
        let inbox = db.inbox.clone();
        tokio::spawn(async move { inbox.record_run(&key("order:3")).await.unwrap() })
    });
    let mut counts = Vec::new();
    for count in counting {
        counts.push(count.await.unwrap());
    }
    counts.sort_unstable();
    assert_eq!(counts, (1..=10).collect::<Vec<u64>>(), "each count once");

    // Purged with this consumer's keys once the last run is older than the cutoff.
    let table = format!("{}runs", db.prefix);
    DB::age_rows(db.inbox.pool(), table, "last_run_at", 8 * DAY_MS).await;
    assert_eq!(db.inbox.record_run(&key("order:2")).await.unwrap(), 2);
    let week = Duration::from_secs(7 * 86_400);
    // order:1 in both scopes and order:3; order:2 ran just now, audit's is another
    // consumer's. The figure is of keys: there are none.
    assert_eq!(db.inbox.purge(week, 2).await.unwrap(), 0);
    assert_eq!(db.rows("runs").await, 2);
    assert_eq!(db.inbox.record_run(&key("order:1")).await.unwrap(), 1);
    assert_eq!(db.inbox.record_run(&key("order:2")).await.unwrap(), 3);

    // A dead letter's count is forgotten for its consumer and scope only: a replay of it
    // counts from 1.
    assert!(db.inbox.forget_runs(&key("order:1")).await.unwrap());
    assert!(
        !db.inbox.forget_runs(&key("order:1")).await.unwrap(),
        "gone"
    );
    assert_eq!(audit.record_run(&key("order:1")).await.unwrap(), 2);
    assert!(
        !tenant.forget_runs(&key("order:2")).await.unwrap(),
        "none in acme"
    );
    assert_eq!(db.inbox.record_run(&key("order:2")).await.unwrap(), 4);
    assert_eq!(db.inbox.record_run(&key("order:1")).await.unwrap(), 1);
    db.cleanup().await;
}

async fn first_runs_are_counted_together_only_while_none_of_the_keys_has_a_count<
    DB: TestBackend,
>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let (one, two, three) = (key("order:1"), key("order:2"), key("order:3"));
    // A key given twice is counted once.
    let counted = db.inbox.record_first_runs(&[&one, &two, &one]).await;
    assert!(counted.unwrap(), "none had a count");
    assert_eq!(db.rows("runs").await, 2);
    // One of them has a count: none is counted, order:3 neither.
    let counted = db.inbox.record_first_runs(&[&three, &two]).await;
    assert!(!counted.unwrap(), "order:2 has a count");
    assert_eq!(db.rows("runs").await, 2);
    // The counts go on from the first run: the batch's was the first of each.
    assert_eq!(db.inbox.record_run(&one).await.unwrap(), 2);
    assert_eq!(db.inbox.record_run(&three).await.unwrap(), 1);
    // Apart for each scope and consumer.
    let tenant = db.inbox.with_scope(Scope::new("acme").unwrap());
    assert!(tenant.record_first_runs(&[&one, &two]).await.unwrap());
    let audit = db.consumer("audit");
    assert!(audit.record_first_runs(&[&one, &two]).await.unwrap());
    assert_eq!(db.rows("runs").await, 7);
    db.cleanup().await;
}
