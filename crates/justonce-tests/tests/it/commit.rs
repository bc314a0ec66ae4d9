//! A COMMIT whose answer never arrives: a proxy between the runner and PostgreSQL breaks
//! the connection right after COMMIT, once having forwarded it and once not; and the same
//! for the one statement of `run_forward`, `run_effect` and a shared commit, which commits
//! on its own.

use super::key;
use justonce_sql::{Consumer, Effect, Error, Inbox, InboxOptions, Message, Outcome, RunError};
use justonce_tests::{TestBackend, TestDb, postgres_url};
use sqlx::Postgres;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone, Copy, PartialEq)]
enum Cut {
    /// The server receives COMMIT and commits; the client never hears back.
    AfterForwarding,
    /// The server never receives COMMIT, sees the connection close and rolls back.
    BeforeForwarding,
}

/// sqlx's COMMIT.
const COMMIT: &[u8] = b"COMMIT";

/// Forwards connections to PostgreSQL, and breaks the first one that sends `trigger`. With
/// `then_refuse`, every connection after that is closed at once: the database stays out of
/// reach. Its port, and a flag that is false once it has cut.
async fn proxy(
    upstream: String,
    trigger: &'static [u8],
    cut: Cut,
    then_refuse: bool,
) -> (u16, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let armed = Arc::new(AtomicBool::new(true));
    let cut_yet = Arc::clone(&armed);
    tokio::spawn(async move {
        loop {
            let (client, _) = listener.accept().await.unwrap();
            if then_refuse && !armed.load(Ordering::SeqCst) {
                continue; // dropping `client` closes it
            }
            let server = TcpStream::connect(&upstream).await.unwrap();
            tokio::spawn(relay(client, server, trigger, cut, Arc::clone(&armed)));
        }
    });
    (port, cut_yet)
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    trigger: &[u8],
    cut: Cut,
    armed: Arc<AtomicBool>,
) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let cutting = Arc::new(AtomicBool::new(false));
    let silenced = Arc::clone(&cutting);
    let answers = tokio::spawn(async move {
        let mut buffer = vec![0; 64 * 1024];
        loop {
            let read = from_server.read(&mut buffer).await.unwrap_or(0);
            if read == 0 || silenced.load(Ordering::SeqCst) {
                return; // dropping `to_client` closes the client's connection
            }
            to_client.write_all(&buffer[..read]).await.unwrap();
        }
    });
    let mut buffer = vec![0; 64 * 1024];
    loop {
        let read = from_client.read(&mut buffer).await.unwrap_or(0);
        if read == 0 {
            break;
        }
        let chunk = &buffer[..read];
        let triggered = chunk.windows(trigger.len()).any(|w| w == trigger);
        if triggered && armed.swap(false, Ordering::SeqCst) {
            cutting.store(true, Ordering::SeqCst);
            match cut {
                Cut::AfterForwarding => {
                    to_server.write_all(chunk).await.unwrap();
                    // The server's answer proves the commit; the answer task drops it
                    // and closes the client's connection.
                    let _ = answers.await;
                }
                Cut::BeforeForwarding => answers.abort(),
            }
            return;
        }
        to_server.write_all(chunk).await.unwrap();
    }
}

/// An inbox on fresh tables whose connections go through a proxy that cuts at `trigger`;
/// with `share`, it shares commits, one shared commit at a time.
async fn inbox_through_proxy(
    trigger: &'static [u8],
    cut: Cut,
    then_refuse: bool,
    share: bool,
) -> (TestDb<Postgres>, Inbox<Postgres>, Arc<AtomicBool>) {
    let db = TestDb::<Postgres>::new("commit").await;
    let direct = PgConnectOptions::from_str(&postgres_url()).unwrap();
    let upstream = format!("{}:{}", direct.get_host(), direct.get_port());
    let (port, armed) = proxy(upstream, trigger, cut, then_refuse).await;
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(1))
        // The proxy reads the protocol to find the COMMIT: in plain text, never TLS.
        .connect_with(
            direct
                .clone()
                .host("127.0.0.1")
                .port(port)
                .ssl_mode(PgSslMode::Disable),
        )
        .await
        .unwrap();
    let inbox = Inbox::<Postgres>::from_pool(
        pool,
        Consumer::new("test").unwrap(),
        InboxOptions::default()
            .prefix(&db.prefix)
            .max_attempts(2)
            .pool_size(2)
            .share_commits(share),
    )
    .unwrap();
    (db, inbox, armed)
}

/// Runs one unit of work through a proxy that cuts its COMMIT; returns what `run` returned,
/// how often the work ran, and how many effect rows exist.
async fn run_through_proxy(cut: Cut, then_refuse: bool) -> (Result<Outcome<u32>, Error>, u32, i64) {
    let (db, inbox, _) = inbox_through_proxy(COMMIT, cut, then_refuse, false).await;
    let id = key("payment:1");
    let (key, prefix) = (&id, db.prefix.as_str());
    let mut calls = 0;
    let outcome = inbox
        .run(key, b"p", |tx| {
            calls += 1;
            let call = calls;
            Box::pin(async move {
                Postgres::insert_effect(tx, prefix, "test", key.as_str()).await?;
                Ok::<_, sqlx::Error>(call)
            })
        })
        .await
        .map_err(|error| match error {
            RunError::Store(error) => error,
            other => panic!("the work failed: {other}"),
        });
    let effects = db.effects_of(&id).await;
    db.cleanup().await;
    (outcome, calls, effects)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_happened_is_found_and_not_run_again() {
    let (outcome, calls, effects) = run_through_proxy(Cut::AfterForwarding, false).await;
    assert_eq!(
        outcome.unwrap(),
        Outcome::Processed(1),
        "the first call's result"
    );
    assert_eq!((calls, effects), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_did_not_happen_is_run_again() {
    let (outcome, calls, effects) = run_through_proxy(Cut::BeforeForwarding, false).await;
    assert_eq!(outcome.unwrap(), Outcome::Processed(2));
    assert_eq!((calls, effects), (2, 1));
}

/// The commit happened, but the database cannot be reached to find out: the run says so,
/// so that the caller does not acknowledge; the effect exists once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_cannot_be_resolved_is_reported_unknown() {
    let (outcome, calls, effects) = run_through_proxy(Cut::AfterForwarding, true).await;
    assert!(
        matches!(outcome, Err(Error::CommitUnknown { .. })),
        "{outcome:?}"
    );
    assert_eq!((calls, effects), (1, 1));
}

/// Forwards one event through a proxy that cuts the connection on the statement that
/// carries its key, the claim and the row in one; returns what `run_forward` returned and
/// the rows of the keys and outbox tables.
async fn forward_through_proxy(
    cut: Cut,
    then_refuse: bool,
) -> (Result<Outcome<()>, Error>, i64, i64) {
    const EVENT: &str = "shop:evt_cut";
    let (db, inbox, _) = inbox_through_proxy(EVENT.as_bytes(), cut, then_refuse, false).await;
    let message = Message::new("sink", b"evt".to_vec());
    let outcome = inbox.run_forward(&key(EVENT), b"evt", message).await;
    let rows = (db.rows("keys").await, db.rows("outbox").await);
    db.cleanup().await;
    (outcome, rows.0, rows.1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_that_committed_is_found_and_not_written_again() {
    let (outcome, keys, rows) = forward_through_proxy(Cut::AfterForwarding, false).await;
    assert_eq!(outcome.unwrap(), Outcome::Processed(()));
    assert_eq!((keys, rows), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_that_did_not_commit_is_written_by_the_next_attempt() {
    let (outcome, keys, rows) = forward_through_proxy(Cut::BeforeForwarding, false).await;
    assert_eq!(outcome.unwrap(), Outcome::Processed(()));
    assert_eq!((keys, rows), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_that_cannot_be_resolved_is_reported_unknown() {
    let (outcome, keys, rows) = forward_through_proxy(Cut::AfterForwarding, true).await;
    assert!(
        matches!(outcome, Err(Error::CommitUnknown { .. })),
        "{outcome:?}"
    );
    assert_eq!((keys, rows), (1, 1));
}

/// Runs one effect through a proxy that cuts the connection on the statement that carries
/// its key, the claim and the effect in one; returns what `run_effect` returned and the
/// rows of the keys and effect tables.
async fn effect_through_proxy(
    cut: Cut,
    then_refuse: bool,
) -> (Result<Outcome<Option<u64>>, Error>, i64, i64) {
    const PAYMENT: &str = "payment:cut";
    let (db, inbox, _) = inbox_through_proxy(PAYMENT.as_bytes(), cut, then_refuse, false).await;
    let effect = Effect::<Postgres>::new(format!(
        "INSERT INTO {}effects (consumer, msg_key) SELECT $1, $2 FROM claimed",
        db.prefix
    ))
    .bind("test")
    .bind(PAYMENT);
    let outcome = inbox.run_effect(&key(PAYMENT), b"p", &effect).await;
    let rows = (db.rows("keys").await, db.rows("effects").await);
    db.cleanup().await;
    (outcome, rows.0, rows.1)
}

/// The statement committed and its answer was lost: the claim read back says so, and how
/// many rows it changed is not known.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_that_committed_is_found_and_not_run_again() {
    let (outcome, keys, effects) = effect_through_proxy(Cut::AfterForwarding, false).await;
    assert_eq!(outcome.unwrap(), Outcome::Processed(None));
    assert_eq!((keys, effects), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_that_did_not_commit_is_run_by_the_next_attempt() {
    let (outcome, keys, effects) = effect_through_proxy(Cut::BeforeForwarding, false).await;
    assert_eq!(outcome.unwrap(), Outcome::Processed(Some(1)));
    assert_eq!((keys, effects), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_that_cannot_be_resolved_is_reported_unknown() {
    let (outcome, keys, effects) = effect_through_proxy(Cut::AfterForwarding, true).await;
    assert!(
        matches!(outcome, Err(Error::CommitUnknown { .. })),
        "{outcome:?}"
    );
    assert_eq!((keys, effects), (1, 1));
}

/// The consumer `test` twice in a row, each after its length: elements of an array
/// parameter, which only a shared commit's statement binds. A lone call's statement binds
/// its consumer once.
const GROUP: &[u8] = b"\0\0\0\x04test\0\0\0\x04test";

/// Twenty forwards at once through an inbox that shares commits: the first commits alone,
/// in its one statement; the others wait for it, then share one statement, committed on
/// its own, whose answer the proxy cuts. Each is processed once, whether that statement
/// committed (read back by the group's claim id) or not (written again).
async fn shared_forwards_through_proxy(cut: Cut) -> (Vec<Outcome<()>>, i64, i64) {
    let (db, inbox, armed) = inbox_through_proxy(GROUP, cut, false, true).await;
    let forwards = (0..20).map(|n| {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            let message = Message::new("sink", b"evt".to_vec());
            let event = key(&format!("shop:evt_{n}"));
            inbox.run_forward(&event, b"evt", message).await
        })
    });
    let outcomes = futures_util::future::join_all(forwards)
        .await
        .into_iter()
        .map(|forward| forward.unwrap().expect("stored"))
        .collect();
    assert!(
        !armed.load(Ordering::SeqCst),
        "no shared commit's statement was cut"
    );
    let rows = (db.rows("keys").await, db.rows("outbox").await);
    db.cleanup().await;
    (outcomes, rows.0, rows.1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_commit_that_happened_is_found_and_not_written_again() {
    let (outcomes, keys, rows) = shared_forwards_through_proxy(Cut::AfterForwarding).await;
    assert_eq!(outcomes, vec![Outcome::Processed(()); 20]);
    assert_eq!((keys, rows), (20, 20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_commit_that_did_not_happen_is_written_call_by_call() {
    let (outcomes, keys, rows) = shared_forwards_through_proxy(Cut::BeforeForwarding).await;
    assert_eq!(outcomes, vec![Outcome::Processed(()); 20]);
    assert_eq!((keys, rows), (20, 20));
}
