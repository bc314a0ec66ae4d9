//! How the inbox's pool tests a connection before handing it out.
//!
//! sqlx pings every connection it hands out: a round trip before each transaction, on the
//! path of every message. It also pings each connection it takes back, so a connection in
//! the pool answered a moment ago. This pool pings only a connection that sat idle for
//! longer than [`PING_IDLE_AFTER`]; one used more recently is tested by its first
//! statement. [`Inbox::begin`](crate::Inbox::begin) replaces a connection whose BEGIN
//! finds it broken, at once, as a failed ping would have.

use std::time::Duration;

/// How long a connection may sit in the pool and still be handed out without a ping.
pub(crate) const PING_IDLE_AFTER: Duration = Duration::from_secs(1);

/// The inbox's pool: at most `size` connections, waiting up to `acquire_timeout` for one,
/// each pinged before use only after sitting idle past [`PING_IDLE_AFTER`].
pub(crate) fn options<DB: sqlx::Database>(
    size: u32,
    acquire_timeout: Duration,
) -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::new()
        .max_connections(size)
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| Box::pin(answers_if_idle(conn, meta.idle_for)))
}

/// Whether a connection idle for `idle_for` may be handed out: one idle past
/// [`PING_IDLE_AFTER`] must answer a ping. One that does not is closed and another taken.
pub(crate) async fn answers_if_idle<C: sqlx::Connection>(
    conn: &mut C,
    idle_for: Duration,
) -> Result<bool, sqlx::Error> {
    Ok(idle_for <= PING_IDLE_AFTER || conn.ping().await.is_ok())
}
