//! One integration binary: every test body runs against SQLite and the real PostgreSQL.

mod claim;
mod client;
mod commit;
mod crash;
mod http;
mod idempotency;
mod lease;
mod outbox;
mod payments;
mod purge;
mod receiver;
mod relay_crash;
mod run;
mod schema;

use justonce_sql::{Inbox, Key, Outcome};
use justonce_tests::{TestBackend, TestDb};

/// Fans each generic test body out into one test per database: `module::sqlite::name` and
/// `module::postgres::name`.
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
    };
}
pub(crate) use on_every_database;

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
