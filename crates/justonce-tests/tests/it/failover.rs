//! PostgreSQL failover on throwaway clusters of the test's own: a store on the multi-host
//! URL of a primary and its synchronous standby, the primary killed with SIGKILL mid-run
//! and the standby promoted. The same pool goes on writing on the new primary, and every
//! write that returned success is there. The old primary then comes back as a standby,
//! still first in the URL, and is passed by.

use super::closed_port;
use justonce_sql::{Consumer, Error, Inbox, InboxOptions, Key, Outcome, RunError};
use justonce_tests::cluster::Cluster;
use justonce_tests::{TestBackend, TestDb, postgres_url};
use sqlx::Postgres;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Events each writer stores, one after the other.
const EVENTS_PER_WRITER: usize = 200;
const WRITERS: usize = 2;
/// Events acknowledged before the primary is killed.
const KILLED_AFTER: usize = 100;
/// Events written after the old primary came back as a standby.
const AFTER_REJOIN: usize = 20;

/// What one writer saw: the keys acknowledged, and the errors of the attempts refused.
struct Written {
    acknowledged: Vec<Key>,
    refused: Vec<String>,
}

/// How far the writers got: events acknowledged, attempts refused.
#[derive(Default)]
struct Progress {
    done: AtomicUsize,
    refused: AtomicUsize,
}

/// Stores events `event:<writer>:<n>` in order, each tried again until it is acknowledged
/// (processed, or a duplicate of an earlier attempt that committed). A refusal must be the
/// store's typed error, never the work's.
async fn write(
    inbox: Inbox<Postgres>,
    prefix: String,
    writer: usize,
    progress: Arc<Progress>,
) -> Written {
    let mut written = Written {
        acknowledged: Vec::new(),
        refused: Vec::new(),
    };
    for n in 0..EVENTS_PER_WRITER {
        let key = Key::new(format!("event:{writer}:{n}")).unwrap();
        loop {
            let (key, prefix) = (&key, prefix.as_str());
            let ran = inbox
                .run(key, b"body", |tx| {
                    Box::pin(async move {
                        Postgres::insert_effect(tx, prefix, "test", key.as_str()).await
                    })
                })
                .await;
            match ran {
                Ok(Outcome::Processed(()) | Outcome::Duplicate) => break,
                Ok(Outcome::KeyReused { .. }) => {
                    panic!("{key}: the same body was taken as another")
                }
                Err(RunError::Store(
                    error @ (Error::Database { .. } | Error::CommitUnknown { .. }),
                )) => {
                    written.refused.push(error.to_string());
                    progress.refused.fetch_add(1, Ordering::Relaxed);
                }
                Err(other) => panic!("{key}: not the store's unavailable error: {other:?}"),
            }
        }
        written.acknowledged.push(key);
        progress.done.fetch_add(1, Ordering::Relaxed);
    }
    written
}

/// Waits until `reached`; a writer that ended first (it panicked, or wrote everything)
/// fails the test, since then `reached` may never hold.
async fn until_writing(
    what: &str,
    writers: &[tokio::task::JoinHandle<Written>],
    reached: impl Fn() -> bool,
) {
    while !reached() {
        assert!(
            !writers.iter().any(tokio::task::JoinHandle::is_finished),
            "a writer ended before {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_the_pool_writes_to_the_new_primary_and_nothing_acknowledged_is_lost() {
    let primary = Cluster::start().expect("a primary of the test's own");
    let standby = primary
        .start_standby(true)
        .expect("a synchronous standby of the test's own");
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port(),
        standby.port()
    );
    let db = TestDb::<Postgres>::at(&url).await;
    // Short waits for a connection: an outage is answered at once, as the service does.
    let inbox = Inbox::<Postgres>::connect_with(
        &url,
        Consumer::new("test").unwrap(),
        InboxOptions::default()
            .prefix(&db.prefix)
            .acquire_timeout(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let progress = Arc::new(Progress::default());
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let (inbox, prefix) = (inbox.clone(), db.prefix.clone());
            tokio::spawn(write(inbox, prefix, writer, Arc::clone(&progress)))
        })
        .collect();
    until_writing("the kill", &writers, || {
        progress.done.load(Ordering::Relaxed) >= KILLED_AFTER
    })
    .await;
    primary.kill().expect("SIGKILL the primary");
    let killed_at = progress.done.load(Ordering::Relaxed);
    // No host accepts writes until the promotion: the writers are refused meanwhile.
    until_writing("a refusal", &writers, || {
        progress.refused.load(Ordering::Relaxed) > 0
    })
    .await;
    standby.promote().expect("promote the standby");

    let mut acknowledged = Vec::new();
    let mut refused = Vec::new();
    for writer in writers {
        let written = writer.await.expect("a writer");
        acknowledged.extend(written.acknowledged);
        refused.extend(written.refused);
    }
    assert_eq!(acknowledged.len(), WRITERS * EVENTS_PER_WRITER);
    assert!(
        killed_at < acknowledged.len(),
        "writes went on after the kill"
    );

    // The pool the writers used is on the promoted standby now.
    let (port, in_recovery): (i32, bool) =
        sqlx::query_as("SELECT inet_server_port(), pg_is_in_recovery()")
            .fetch_one(inbox.pool())
            .await
            .unwrap();
    assert_eq!((port, in_recovery), (i32::from(standby.port()), false));

    // Every acknowledged event is on the new primary, with its effect once.
    let new_primary = sqlx::PgPool::connect(&format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        standby.port()
    ))
    .await
    .unwrap();
    let counts = Postgres::effect_counts(&new_primary, &db.prefix)
        .await
        .unwrap();
    let effects: std::collections::HashMap<String, i64> = counts.into_iter().collect();
    let missing: Vec<&str> = acknowledged
        .iter()
        .map(Key::as_str)
        .filter(|key| !effects.contains_key(*key))
        .collect();
    assert!(missing.is_empty(), "acknowledged but lost: {missing:?}");
    let doubled: Vec<_> = effects.iter().filter(|(_, count)| **count > 1).collect();
    assert!(doubled.is_empty(), "effects twice: {doubled:?}");
    let keys: (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}keys",
        db.prefix
    )))
    .fetch_one(&new_primary)
    .await
    .unwrap();
    assert_eq!(keys.0, i64::try_from(acknowledged.len()).unwrap());
    eprintln!(
        "failover: {} events acknowledged, {killed_at} before the kill; {} attempts refused during the switch",
        acknowledged.len(),
        refused.len()
    );

    // The old primary comes back as a standby of the new one, still first in the URL: a
    // new pool passes it by, and every write goes to the new primary.
    primary
        .rejoin_as_standby_of(&standby)
        .expect("the old primary back as a standby");
    assert_eq!(primary.query("SELECT pg_is_in_recovery()").unwrap(), "t");
    let rejoined = Inbox::<Postgres>::connect_with(
        &url,
        Consumer::new("test").unwrap(),
        InboxOptions::default().prefix(&db.prefix),
    )
    .await
    .unwrap();
    for n in 0..AFTER_REJOIN {
        let key = Key::new(format!("rejoined:{n}")).unwrap();
        let (key, prefix) = (&key, db.prefix.as_str());
        let ran = rejoined
            .run(key, b"body", |tx| {
                Box::pin(
                    async move { Postgres::insert_effect(tx, prefix, "test", key.as_str()).await },
                )
            })
            .await;
        assert!(matches!(ran, Ok(Outcome::Processed(()))), "{key}: {ran:?}");
        let (port, in_recovery): (i32, bool) =
            sqlx::query_as("SELECT inet_server_port(), pg_is_in_recovery()")
                .fetch_one(rejoined.pool())
                .await
                .unwrap();
        assert_eq!((port, in_recovery), (i32::from(standby.port()), false));
    }
    let written: (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}effects WHERE msg_key LIKE 'rejoined:%'",
        db.prefix
    )))
    .fetch_one(&new_primary)
    .await
    .unwrap();
    assert_eq!(written.0, i64::try_from(AFTER_REJOIN).unwrap());
}

/// An inbox on a multi-host URL, dropped without being closed: its failover watcher ends
/// with it, and every connection it opened is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_inbox_leaves_no_connection_behind() {
    let name = format!("justonce-dropped-{}", justonce_tests::unique());
    // The shared server first, then a port nothing listens on.
    let single = postgres_url();
    let authority = single.find("://").unwrap() + 3;
    let path = authority + single[authority..].find('/').unwrap();
    let url = format!(
        "{},127.0.0.1:{}{}?application_name={name}",
        &single[..path],
        closed_port(),
        &single[path..]
    );
    let inbox = Inbox::<Postgres>::connect(&url, Consumer::new("test").unwrap())
        .await
        .unwrap();
    sqlx::query("SELECT 1").execute(inbox.pool()).await.unwrap();
    let observer = sqlx::PgPool::connect(&single).await.unwrap();
    let connections = || async {
        let count: (i64,) =
            sqlx::query_as("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(&name)
                .fetch_one(&observer)
                .await
                .unwrap();
        count.0
    };
    // One in the pool, one the watcher's.
    assert!(connections().await >= 2, "the watcher's connection is open");

    drop(inbox);
    let given_up = Instant::now() + Duration::from_secs(10);
    loop {
        let left = connections().await;
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < given_up,
            "{left} connections left after the inbox was dropped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
