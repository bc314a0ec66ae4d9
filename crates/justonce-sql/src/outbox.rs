//! The transactional outbox: rows written with the work, sent afterwards by the relay with
//! a key the receiver can deduplicate on.

use crate::backend::{Backend, Queries, Reads};
use crate::rows::{Change, ListedTuple, Listing, OutboxRow, Waiting, Which, Window};
use crate::shared::{Shared, in_batches, millis};
use justonce_core::Error;
use justonce_core::trace::{self, TRACEPARENT, TRACESTATE, TraceContext};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// A message to send once the transaction that writes it has committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub(crate) destination: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Vec<(String, String)>,
}

impl Message {
    /// A message for the destination registered with the relay as `destination`.
    pub fn new(destination: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            destination: destination.into(),
            payload: payload.into(),
            headers: Vec::new(),
        }
    }

    /// Adds a header the destination sends along, such as `Content-Type`.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sends the W3C trace `context` along, as the `traceparent` and `tracestate` headers,
    /// in place of any the message had: the delivery then joins that trace. Without a
    /// [`trace::TracePropagator`] the destination receives the context as it is given here;
    /// with one, the delivery's span is a child of it and sends its own.
    ///
    /// ```
    /// use justonce_sql::{Message, TraceContext};
    ///
    /// // The context of the request that caused this work, as its sender sent it.
    /// let context = TraceContext::parse(
    ///     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ///     Some("congo=t61rcWkgMzE"),
    /// )
    /// .expect("a well-formed traceparent");
    /// let message = Message::new("invoice-email", b"{}".to_vec()).trace_context(&context);
    /// assert_eq!(message.trace(), Some(context));
    /// ```
    pub fn trace_context(mut self, context: &TraceContext) -> Self {
        self.headers.retain(|(name, _)| !is_trace_header(name));
        let pairs = context.headers();
        self.headers
            .extend(pairs.map(|(name, value)| (name.to_owned(), value.to_owned())));
        self
    }

    /// The trace context the message carries, if its headers hold a well-formed one.
    pub fn trace(&self) -> Option<TraceContext> {
        TraceContext::from_headers(headers_of(&self.headers))
    }

    /// Headers as stored: a JSON array of `[name, value]` pairs. A message without a trace
    /// context takes the current span's, when a propagator exports it, so that its delivery
    /// joins the trace of the work that wrote it.
    pub(crate) fn headers_json(&self) -> String {
        let mut pairs: Vec<[&str; 2]> = self
            .headers
            .iter()
            .map(|(name, value)| [name.as_str(), value.as_str()])
            .collect();
        let current = match self.trace() {
            Some(_) => None,
            None => trace::context_to_send(&tracing::Span::current(), None),
        };
        if let Some(current) = &current {
            pairs.retain(|[name, _]| !is_trace_header(name));
            pairs.extend(current.headers().map(|(name, value)| [name, value]));
        }
        serde_json::to_string(&pairs).expect("strings always serialize")
    }
}

/// Whether `name` is one of the W3C trace context headers.
pub(crate) fn is_trace_header(name: &str) -> bool {
    name.eq_ignore_ascii_case(TRACEPARENT) || name.eq_ignore_ascii_case(TRACESTATE)
}

/// Header pairs as borrowed name and value.
pub(crate) fn headers_of(headers: &[(String, String)]) -> impl Iterator<Item = (&str, &str)> {
    headers
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_str()))
}

/// Reads headers stored by [`Message::headers_json`].
pub(crate) fn parse_headers(json: &str) -> Result<Vec<(String, String)>, Error> {
    let pairs: Vec<(String, String)> = serde_json::from_str(json).map_err(|e| {
        Error::Schema(format!(
            "stored outbox headers are not a list of pairs: {e}"
        ))
    })?;
    Ok(pairs)
}

/// An outbox row as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Row {
    /// The row's id.
    pub id: i64,
    /// The tenant the row was written for; empty for none.
    pub scope: String,
    /// The downstream idempotency key, the same on every delivery.
    pub key: String,
    /// The destination's name.
    pub destination: String,
    /// The bytes to send.
    pub payload: Vec<u8>,
    /// Headers to send along.
    pub headers: Vec<(String, String)>,
    /// How many deliveries were tried.
    pub attempts: u32,
    /// Why the last delivery failed.
    pub last_error: Option<String>,
    /// Whether the row was dead-lettered.
    pub dead: bool,
    /// Whether the row was sent.
    pub sent: bool,
}

impl Row {
    pub(crate) fn decode(row: OutboxRow) -> Result<Self, Error> {
        Ok(Self {
            id: row.id,
            scope: row.scope,
            key: row.key,
            destination: row.destination,
            payload: row.payload,
            headers: parse_headers(&row.headers)?,
            attempts: u32::try_from(row.attempts).unwrap_or(u32::MAX),
            last_error: row.last_error,
            dead: row.dead,
            sent: row.sent,
        })
    }
}

/// Which rows a listing shows: of one destination, written (or last replayed) within a
/// window of time, after an id, at most a number of them (50 by default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowFilter {
    destination: Option<String>,
    since: Option<Duration>,
    until: Option<Duration>,
    after: Option<i64>,
    limit: u32,
}

impl Default for RowFilter {
    fn default() -> Self {
        Self {
            destination: None,
            since: None,
            until: None,
            after: None,
            limit: 50,
        }
    }
}

impl RowFilter {
    /// Only the rows of this destination.
    pub fn destination(mut self, destination: impl Into<String>) -> Self {
        self.destination = Some(destination.into());
        self
    }

    /// Only rows written at most this long ago, by the store's clock.
    pub fn since(mut self, ago: Duration) -> Self {
        self.since = Some(ago);
        self
    }

    /// Only rows written at least this long ago, by the store's clock.
    pub fn until(mut self, ago: Duration) -> Self {
        self.until = Some(ago);
        self
    }

    /// Only rows whose id is above this one: the cursor of a listing in id order, such as
    /// the dead letters', from the last id of the page before.
    pub fn after(mut self, id: i64) -> Self {
        self.after = Some(id);
        self
    }

    justonce_core::setters!(
        /// At most this many rows.
        limit: u32,
    );

    fn window(&self) -> Window<'_> {
        Window {
            destination: self.destination.as_deref(),
            since_ms: self.since.map(millis),
            until_ms: self.until.map(millis),
        }
    }

    fn listing(&self, state: Waiting) -> Listing<'_> {
        Listing {
            state,
            window: self.window(),
            after: self.after,
            limit: i64::from(self.limit),
        }
    }
}

/// An outbox row as a listing shows it: without its body, with its attempts and why the
/// last one failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RowSummary {
    /// The row's id.
    pub id: i64,
    /// The tenant the row was written for; empty for none.
    pub scope: String,
    /// The downstream idempotency key.
    pub key: String,
    /// The destination's name.
    pub destination: String,
    /// How many deliveries were tried since the row was written or last replayed.
    pub attempts: u32,
    /// Why the last delivery failed.
    pub last_error: Option<String>,
    /// How long ago the row was written or last replayed, by the store's clock.
    pub age: Duration,
    /// How long until the next delivery is tried; zero when it is due now.
    pub next_attempt_in: Duration,
}

impl From<ListedTuple> for RowSummary {
    fn from(row: ListedTuple) -> Self {
        let (id, scope, key, destination, attempts, last_error, age_ms, next_in_ms) = row;
        let duration = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0));
        Self {
            id,
            scope,
            key,
            destination,
            attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
            last_error,
            age: duration(age_ms),
            next_attempt_in: duration(next_in_ms),
        }
    }
}

/// One delivery attempt, as the relay recorded it in the row's history.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Attempt {
    /// The row's attempt it was, counting from 1; a replay counts again from 1.
    pub attempt: u32,
    /// When it started, by the store's clock.
    pub started_at: SystemTime,
    /// How long the destination took to answer or fail.
    pub duration: Duration,
    /// The HTTP status the receiver answered, if it speaks HTTP and answered.
    pub status: Option<u16>,
    /// The start of the receiver's answer, at most 512 bytes, as safe text.
    pub answer: Option<String>,
    /// Why the attempt failed (a connection error, a refusing status); `None` when the
    /// destination took the row.
    pub error: Option<String>,
}

impl Attempt {
    /// The attempts of a history as stored, oldest first.
    pub(crate) fn parse_history(json: &str) -> Result<Vec<Self>, Error> {
        let malformed = |what: &str| Error::Schema(format!("a stored delivery history {what}"));
        let entries: Vec<Value> =
            serde_json::from_str(json).map_err(|e| malformed(&format!("is not a list: {e}")))?;
        entries
            .iter()
            .map(|entry| {
                let number = |name: &str| entry.get(name).and_then(Value::as_i64);
                let text = |name: &str| entry.get(name).and_then(Value::as_str).map(str::to_owned);
                let (Some(attempt), Some(at_ms), Some(duration_ms)) =
                    (number("attempt"), number("at"), number("ms"))
                else {
                    return Err(malformed("has an attempt without its number or time"));
                };
                let duration = Duration::from_millis(u64::try_from(duration_ms).unwrap_or(0));
                // The time stored is when the attempt was recorded, at its end.
                let ended = SystemTime::UNIX_EPOCH
                    + Duration::from_millis(u64::try_from(at_ms).unwrap_or(0));
                Ok(Self {
                    attempt: u32::try_from(attempt).unwrap_or(0),
                    started_at: ended.checked_sub(duration).unwrap_or(ended),
                    duration,
                    status: number("status").and_then(|status| u16::try_from(status).ok()),
                    answer: text("answer"),
                    error: text("error"),
                })
            })
            .collect()
    }
}

/// Counts of outbox rows by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Rows the destination took.
    pub sent: i64,
    /// Rows waiting for a first or a next delivery.
    pub due: i64,
    /// Dead letters.
    pub dead: i64,
    /// How long the oldest due row has waited since it was written; zero when none is due.
    pub oldest_due: Duration,
}

impl OutboxStats {
    fn new(sent: i64, due: i64, dead: i64, oldest_due_ms: i64) -> Self {
        Self {
            sent,
            due,
            dead,
            oldest_due: Duration::from_millis(oldest_due_ms.max(0).unsigned_abs()),
        }
    }
}

/// A destination a relay backed off for one scope after failures in a row, as it last
/// wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackedOff {
    /// The destination's name.
    pub destination: String,
    /// The scope whose deliveries it backed off: a tenant, or empty for rows without one.
    pub scope: String,
    /// Failures in a row when the breaker last opened.
    pub failures: u32,
    /// How long the pause has left; zero once a probe may go through.
    pub pause_left: Duration,
    /// How long ago the breaker last opened.
    pub since: Duration,
}

/// The outbox of one store: dead letters and clean-up. Made by [`crate::Inbox::outbox`].
pub struct Outbox<DB: Backend> {
    pub(crate) shared: Arc<Shared<DB>>,
}

impl<DB: Backend> Clone for Outbox<DB> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<DB: Backend> Outbox<DB> {
    /// Dead-lettered rows, oldest first, at most `limit`.
    pub async fn dead_letters(&self, limit: u32) -> Result<Vec<Row>, Error> {
        let which = Which::DeadLetters {
            limit: i64::from(limit),
        };
        let rows = self
            .shared
            .sql
            .outbox_rows(&self.shared.pool, which)
            .await?;
        rows.into_iter().map(Row::decode).collect()
    }

    /// Rows waiting for a delivery (a first one or a retry), the oldest first.
    pub async fn list_due(&self, filter: &RowFilter) -> Result<Vec<RowSummary>, Error> {
        self.list(filter.listing(Waiting::Due)).await
    }

    /// Dead letters, oldest first.
    pub async fn list_dead(&self, filter: &RowFilter) -> Result<Vec<RowSummary>, Error> {
        self.list(filter.listing(Waiting::Dead)).await
    }

    async fn list(&self, listing: Listing<'_>) -> Result<Vec<RowSummary>, Error> {
        let rows = self.shared.sql.list(&self.shared.pool, listing).await?;
        Ok(rows.into_iter().map(RowSummary::from).collect())
    }

    /// A row's last delivery attempts, oldest first: at most the last 25 since it was
    /// written, replays included. Empty for a row never tried or not stored.
    pub async fn attempts(&self, id: i64) -> Result<Vec<Attempt>, Error> {
        let history = self.shared.sql.history(&self.shared.pool, id).await?;
        history.map_or(Ok(Vec::new()), |json| Attempt::parse_history(&json))
    }

    /// The ids of the rows written with this downstream `key`, in order: one per
    /// destination the work wrote to.
    pub async fn ids_with_key(&self, key: &str) -> Result<Vec<i64>, Error> {
        self.shared.sql.ids_by_key(&self.shared.pool, key).await
    }

    /// One row, sent, due or dead.
    pub async fn get(&self, id: i64) -> Result<Option<Row>, Error> {
        let rows = self
            .shared
            .sql
            .outbox_rows(&self.shared.pool, Which::Id(id))
            .await?;
        rows.into_iter().next().map(Row::decode).transpose()
    }

    /// Puts a dead letter back to due, with its attempts reset and the same key, so that
    /// the relay sends it again. Returns whether the row was a dead letter.
    pub async fn replay(&self, id: i64) -> Result<bool, Error> {
        let change = Change::Replay {
            id: Some(id),
            window: Window::default(),
            limit: 1,
        };
        Ok(self.change(change).await? > 0)
    }

    /// Replays every dead letter in one statement; returns how many.
    pub async fn replay_all(&self) -> Result<u64, Error> {
        self.replay_batch(u32::MAX).await
    }

    /// Replays at most `batch_size` dead letters, oldest first, and returns how many, so
    /// that a caller replaying many can report its progress between batches. A row
    /// replayed may die again (a destination that still refuses it) and be picked by a
    /// later batch: bound such a loop by the count of dead letters it started from.
    pub async fn replay_batch(&self, batch_size: u32) -> Result<u64, Error> {
        self.replay_matching(&RowFilter::default().limit(batch_size))
            .await
    }

    /// Replays the dead letters of `filter`'s destination and window of time, at most its
    /// limit, oldest first; returns how many. Its `after` does not apply.
    pub async fn replay_matching(&self, filter: &RowFilter) -> Result<u64, Error> {
        let change = Change::Replay {
            id: None,
            window: filter.window(),
            limit: i64::from(filter.limit.max(1)),
        };
        self.change(change).await
    }

    /// Deletes every dead letter; returns how many.
    pub async fn purge_dead_letters(&self) -> Result<u64, Error> {
        self.purge_dead_matching(&RowFilter::default()).await
    }

    /// Deletes every dead letter of `filter`'s destination and window of time, in one
    /// statement; returns how many. Its limit and `after` do not apply.
    pub async fn purge_dead_matching(&self, filter: &RowFilter) -> Result<u64, Error> {
        let window = filter.window();
        self.change(Change::PurgeDead { window }).await
    }

    /// Deletes rows sent more than `older_than` ago (by the database's clock),
    /// `batch_size` per statement; returns how many.
    pub async fn purge_sent(&self, older_than: Duration, batch_size: u32) -> Result<u64, Error> {
        in_batches(batch_size, |limit| {
            self.purge_sent_batch(older_than, u32::try_from(limit).unwrap_or(u32::MAX))
        })
        .await
    }

    /// One statement of [`Outbox::purge_sent`]: deletes at most `batch_size` rows and
    /// returns how many it did; fewer than `batch_size` means none are left.
    pub async fn purge_sent_batch(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, Error> {
        self.change(Change::PurgeSent {
            older_than_ms: millis(older_than),
            limit: i64::from(batch_size.max(1)),
        })
        .await
    }

    /// How many rows are sent, due and dead, and how long the oldest due row has waited.
    pub async fn stats(&self) -> Result<OutboxStats, Error> {
        let (sent, due, dead, oldest_due_ms) =
            self.shared.sql.outbox_stats(&self.shared.pool).await?;
        Ok(OutboxStats::new(sent, due, dead, oldest_due_ms))
    }

    /// [`stats`](Self::stats) for each destination that has rows, ordered by destination.
    pub async fn stats_by_destination(&self) -> Result<Vec<(String, OutboxStats)>, Error> {
        let rows = self.shared.sql.destination_stats(&self.shared.pool).await?;
        Ok(rows
            .into_iter()
            .map(|(destination, sent, due, dead, oldest_due_ms)| {
                (
                    destination,
                    OutboxStats::new(sent, due, dead, oldest_due_ms),
                )
            })
            .collect())
    }

    /// The destinations whose breaker is open or probing, by name and scope. Each relay
    /// has its own breakers, one for each destination and scope; this is what the relays
    /// last wrote. A relay that stopped while its breaker
    /// was open leaves it here until another relay's breaker for it closes.
    pub async fn backed_off(&self) -> Result<Vec<BackedOff>, Error> {
        let rows = self.shared.sql.breakers(&self.shared.pool).await?;
        let duration = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0));
        Ok(rows
            .into_iter()
            .map(
                |(destination, scope, failures, left_ms, age_ms)| BackedOff {
                    destination,
                    scope,
                    failures: u32::try_from(failures).unwrap_or(u32::MAX),
                    pause_left: duration(left_ms),
                    since: duration(age_ms),
                },
            )
            .collect())
    }

    pub(crate) async fn change(&self, change: Change<'_>) -> Result<u64, Error> {
        let replay = matches!(
            change,
            Change::Replay { .. } | Change::ReplayEvent { .. } | Change::ReplayKey { .. }
        );
        let changed = {
            let _writer = self.shared.queue_writer().await;
            self.shared.sql.change(&self.shared.pool, change).await?
        };
        if replay && changed > 0 {
            self.shared.wake_relays_now().await;
        }
        Ok(changed)
    }
}
