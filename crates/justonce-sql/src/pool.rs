//! How the inbox's pool tests a connection before handing it out.
//!
//! sqlx pings every connection it hands out: a round trip before each transaction, on the
//! path of every message. This pool skips the ping for a transaction's connection
//! ([`begin`]): BEGIN tests the connection as well, and a connection it finds broken is
//! replaced at once, as a failed ping would have been. Every other use is pinged first, so
//! that a statement outside a transaction never runs on a connection that broke while idle.

use crate::backend::Backend;
use std::future::Future;

tokio::task_local! {
    /// Set while [`begin`] takes its connection.
    static BEGINNING: ();
}

/// The inbox's pool: at most `size` connections, waiting up to `acquire_timeout` for one.
pub(crate) fn options<DB: sqlx::Database>(
    size: u32,
    acquire_timeout: std::time::Duration,
) -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::new()
        .max_connections(size)
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, _| Box::pin(answers_unless_beginning(conn)))
}

/// Whether a connection may be handed out: one taken for a BEGIN may, any other must
/// answer a ping. One that does not is closed and another taken.
pub(crate) async fn answers_unless_beginning<C: sqlx::Connection>(
    conn: &mut C,
) -> Result<bool, sqlx::Error> {
    Ok(BEGINNING.try_with(|_| ()).is_ok() || conn.ping().await.is_ok())
}

/// Opens a transaction on a connection of `pool` handed out without a ping, as the
/// database's writers begin theirs (`DB::BEGIN`). A connection found broken by its BEGIN
/// is replaced at once, up to the pool's size.
pub(crate) async fn begin<DB: Backend>(
    pool: &sqlx::Pool<DB>,
) -> Result<sqlx::Transaction<'static, DB>, sqlx::Error> {
    let mut replaced = 0;
    loop {
        match unpinged(pool.begin_with(DB::BEGIN)).await {
            // Nothing was done on it: BEGIN was its first statement.
            Err(error)
                if DB::is_commit_unknown(&error)
                    && replaced < pool.options().get_max_connections() =>
            {
                tracing::debug!(%error, "a pooled connection was broken at BEGIN: taking another");
                replaced += 1;
            }
            begun => return begun,
        }
    }
}

/// Runs `begin`, whose connection is handed out without a ping: its BEGIN tests it.
async fn unpinged<F: Future>(begin: F) -> F::Output {
    BEGINNING.scope((), begin).await
}
