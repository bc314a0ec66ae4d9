//! The `justonce` binary end to end: real HTTP on loopback, real databases, a real receiver
//! of the deliveries, and a server killed with SIGKILL.

/// Fans a test `async fn NAME<DB: TestBackend>(name: &str)` out over SQLite, PostgreSQL and
/// MariaDB, one `#[tokio::test]` each in a module named after the database.
macro_rules! on_every_database {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<justonce_sql::sqlx::Sqlite>(stringify!($test)).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<justonce_sql::sqlx::Postgres>(stringify!($test)).await
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<justonce_sql::sqlx::MySql>(stringify!($test)).await
                }
            )*
        }
    };
}

mod admin_api;
mod bench;
mod broker_tls;
mod browser;
mod check;
mod deliveries;
mod environment;
mod events;
mod failover;
mod first_run;
mod folder;
mod listeners;
mod operations;
mod peers;
mod roles;
mod serve;
mod tenants;
mod tls;
mod traces;
