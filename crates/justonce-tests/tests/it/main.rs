//! One integration binary: every test body runs against SQLite and the real PostgreSQL and
//! MariaDB.

mod amqp;
mod broker;
mod broker_login;
mod broker_tls;
mod check;
mod claim;
mod client;
mod commit;
mod crash;
mod daily_report;
mod dashboard;
mod docs;
mod effect;
mod events;
mod failover;
mod harness;
mod history;
mod hostile;
mod http;
mod idempotency;
mod invoices;
mod kafka;
mod lease;
mod lease_process;
mod mqtt;
mod nats;
mod nats_cluster;
mod outbox;
mod payments;
mod pool;
mod purge;
mod rabbitmq_worker;
mod receiver;
mod recent;
mod redis_streams;
mod relay_crash;
mod run;
mod runs;
mod schema;
mod shared_commits;
mod spans;
mod webhook_handler;

use justonce_sql::Leases;
use justonce_sql::{Inbox, Key, Outcome};
use justonce_tests::{TestBackend, TestDb, TestRedis};
use std::sync::Arc;

/// Fans each generic test body out into one test per database: `module::sqlite::name`,
/// `module::postgres::name` and `module::mysql::name`.
macro_rules! on_every_database {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<sqlx::Sqlite>(stringify!($test)).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<sqlx::Postgres>(stringify!($test)).await
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<sqlx::MySql>(stringify!($test)).await
                }
            )*
        }
    };
}
pub(crate) use on_every_database;

/// A lease store under test.
pub(crate) trait LeaseStore: Sized {
    async fn open(test: &str) -> Self;
    fn leases(&self) -> Arc<dyn Leases>;
    /// The store's URL and prefix, for a worker process.
    fn location(&self) -> [String; 2];
    async fn close(self);
}

impl<DB: TestBackend> LeaseStore for TestDb<DB> {
    async fn open(test: &str) -> Self {
        TestDb::new(test).await
    }

    fn leases(&self) -> Arc<dyn Leases> {
        Arc::new(self.inbox.clone())
    }

    fn location(&self) -> [String; 2] {
        [self.url.clone(), self.prefix.clone()]
    }

    async fn close(self) {
        self.cleanup().await
    }
}

impl LeaseStore for TestRedis {
    async fn open(test: &str) -> Self {
        TestRedis::new(test).await
    }

    fn leases(&self) -> Arc<dyn Leases> {
        Arc::new(self.leases.clone())
    }

    fn location(&self) -> [String; 2] {
        [justonce_tests::redis_url(), self.prefix.clone()]
    }

    async fn close(self) {
        self.cleanup().await
    }
}

/// Fans each generic test body out over every lease store.
macro_rules! on_every_lease_store {
    ($($test:ident),* $(,)?) => {
        mod every_store {
            mod sqlite {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $test() {
                        super::super::$test::<justonce_tests::TestDb<sqlx::Sqlite>>(stringify!($test)).await
                    }
                )*
            }
            mod postgres {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $test() {
                        super::super::$test::<justonce_tests::TestDb<sqlx::Postgres>>(stringify!($test)).await
                    }
                )*
            }
            mod mysql {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $test() {
                        super::super::$test::<justonce_tests::TestDb<sqlx::MySql>>(stringify!($test)).await
                    }
                )*
            }
            mod redis {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $test() {
                        super::super::$test::<justonce_tests::TestRedis>(stringify!($test)).await
                    }
                )*
            }
        }
    };
}
pub(crate) use on_every_lease_store;

/// Runs a broker consumer until `done` holds, then stops it and returns what it counted.
/// `run` starts the consumer with the signal that stops it. A liveness guard, not a timer:
/// it fails once what `progress` measures (such as effect rows) has not changed for a
/// minute, however long a busy machine takes in all.
pub(crate) async fn run_until<R, F, Fut, P, PFut>(
    run: impl FnOnce(tokio::sync::oneshot::Receiver<()>) -> R,
    done: F,
    progress: P,
) -> justonce_transport::ConsumerStats
where
    R: std::future::Future<
            Output = Result<justonce_transport::ConsumerStats, justonce_transport::Error>,
        >,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
    P: Fn() -> PFut,
    PFut: std::future::Future<Output = i64>,
{
    const STALL: std::time::Duration = std::time::Duration::from_secs(60);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = run(stopped);
    let waiting = async {
        let mut measured = progress().await;
        let mut moved_at = tokio::time::Instant::now();
        while !done().await {
            let now = progress().await;
            if now != measured {
                (measured, moved_at) = (now, tokio::time::Instant::now());
            }
            assert!(
                moved_at.elapsed() < STALL,
                "no progress for a minute: still {measured}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        stop.send(()).unwrap();
    };
    let (stats, ()) = tokio::join!(running, waiting);
    stats.unwrap()
}

/// Sends `request` to `app` with no socket, and returns the status, the headers and the
/// whole body.
pub(crate) async fn respond(
    app: &axum::Router,
    request: axum::http::Request<axum::body::Body>,
) -> (
    axum::http::StatusCode,
    axum::http::HeaderMap,
    axum::body::Bytes,
) {
    use tower::ServiceExt;
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    (parts.status, parts.headers, body)
}

/// A small deterministic generator, so that a failing run can be repeated.
pub(crate) struct Xorshift(pub(crate) u64);

impl Xorshift {
    /// Seeded from the clock; the seed is printed, to repeat a failing run with it.
    pub(crate) fn from_clock() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let seed = u64::from(nanos) | 1;
        eprintln!("random seed {seed}");
        Self(seed)
    }

    pub(crate) fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

/// Runs the tests' unit of work for `key`: one effect row, written by `inbox`'s consumer.
async fn process<DB: TestBackend>(
    db: &TestDb<DB>,
    inbox: &Inbox<DB>,
    key: &Key,
    payload: &[u8],
) -> Outcome<()> {
    inbox
        .run(key, payload, |tx| {
            Box::pin(DB::insert_effect(
                tx,
                &db.prefix,
                inbox.consumer().as_str(),
                key.as_str(),
            ))
        })
        .await
        .expect("run")
}

fn key(text: &str) -> Key {
    Key::new(text).unwrap()
}

/// A port on 127.0.0.1 that nothing listens on: a connection to it is refused.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}
