//! Stored events: what a source or consumer stored to be delivered, found by origin, key
//! and time, shown whole with its delivery attempts, and replayed: one, or every one of a
//! time range, with the same key, so that the target gets the same idempotency key.
//!
//! An event is its outbox row: the row the service writes for the destination named after
//! the source or consumer (its origin). A replay puts a delivered or dead row back to due,
//! its attempts counted anew and its history kept; the row is deleted only when its
//! origin's event retention ends ([`Outbox::purge_events`]).

use crate::backend::{Backend, Reads};
use crate::outbox::{Attempt, Outbox, parse_headers};
use crate::rows::{
    Change, EventBy, EventDetailTuple, EventListing, EventTuple, NewReplay, ReplayTuple, Replays,
};
use crate::shared::{in_batches, millis, random_u64};
use justonce_core::Error;
use std::time::{Duration, SystemTime};

/// Counts the events replayed, by origin and by how they were picked (`event`, `key`,
/// `range`).
pub const REPLAYED_EVENTS: &str = "justonce_replayed_events_total";

/// How far back a search by part of the key reads when its filter sets no start: a day.
pub const KEY_CONTAINS_WINDOW: Duration = Duration::from_secs(24 * 3_600);

/// Where an event is in its delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventState {
    /// The target took it.
    Delivered,
    /// Waiting for a first delivery, a retry, or a replay's delivery.
    Due,
    /// Dead-lettered: the target refused it, or it was not delivered in time.
    Dead,
}

impl EventState {
    /// Every state, in the order a listing of them is written.
    pub const ALL: [EventState; 3] = [EventState::Delivered, EventState::Due, EventState::Dead];

    /// `delivered`, `due` or `dead`.
    pub fn as_str(self) -> &'static str {
        match self {
            EventState::Delivered => "delivered",
            EventState::Due => "due",
            EventState::Dead => "dead",
        }
    }
}

impl std::fmt::Display for EventState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for EventState {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == text)
            .ok_or_else(|| format!("{text:?} is not one of delivered, due, dead"))
    }
}

/// Which stored events a listing shows, oldest first (by time received, then id), a page
/// of at most `limit` (50 by default) at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFilter {
    origin: Option<String>,
    key_prefix: Option<String>,
    key_part: Option<String>,
    since: Option<SystemTime>,
    until: Option<SystemTime>,
    state: Option<EventState>,
    after: Option<(i64, i64)>,
    limit: u32,
}

impl Default for EventFilter {
    fn default() -> Self {
        Self {
            origin: None,
            key_prefix: None,
            key_part: None,
            since: None,
            until: None,
            state: None,
            after: None,
            limit: 50,
        }
    }
}

impl EventFilter {
    /// Only the events of this source or consumer.
    pub fn origin(mut self, origin: impl Into<String>) -> Self {
        self.origin = Some(origin.into());
        self
    }

    /// Only the events whose key starts with `prefix`, byte for byte. An index on the key
    /// finds them, however many events are stored.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = Some(prefix.into());
        self
    }

    /// Only the events whose key contains `part` anywhere, byte for byte: `%`, `_` and
    /// `\` are characters like any other. No index serves this: the store reads the events
    /// the other filters select, in order, until it has a page. So that it never reads the
    /// whole outbox, a filter with no [`since`](Self::since) searches the events received
    /// within [`KEY_CONTAINS_WINDOW`] before its [`until`](Self::until), or before now;
    /// [`EventPage::searched_since`] says where that window began.
    pub fn key_contains(mut self, part: impl Into<String>) -> Self {
        self.key_part = Some(part.into());
        self
    }

    /// Only events received at or after this time, by the store's clock.
    pub fn since(mut self, time: SystemTime) -> Self {
        self.since = Some(time);
        self
    }

    /// Only events received at or before this time, by the store's clock.
    pub fn until(mut self, time: SystemTime) -> Self {
        self.until = Some(time);
        self
    }

    /// Only the events in this state.
    pub fn state(mut self, state: EventState) -> Self {
        self.state = Some(state);
        self
    }

    /// The page after the one whose [`EventPage::next`] this is; [`Error::InvalidCursor`]
    /// for a cursor no listing handed out.
    pub fn after(mut self, cursor: &str) -> Result<Self, Error> {
        self.after = Some(parse_cursor(cursor)?);
        Ok(self)
    }

    justonce_core::setters!(
        /// At most this many events a page.
        limit: u32,
    );
}

/// A stored event as a listing shows it: without its body.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Event {
    /// The event's id, its outbox row's.
    pub id: i64,
    /// The tenant the event was stored for; empty for none.
    pub scope: String,
    /// The event's key, the idempotency key its target receives.
    pub key: String,
    /// The source or consumer that stored it: the destination named after it.
    pub origin: String,
    /// When it was stored, by the store's clock.
    pub received_at: SystemTime,
    /// Where it is in its delivery.
    pub state: EventState,
    /// Delivery attempts since it was stored or last replayed.
    pub attempts: u32,
    /// Why the last delivery failed.
    pub last_error: Option<String>,
}

impl Event {
    fn decode(row: EventTuple) -> Result<Self, Error> {
        let (id, scope, key, origin, received_us, state, attempts, last_error) = row;
        Ok(Self {
            id,
            scope,
            key,
            origin,
            received_at: time_of(received_us),
            state: state
                .parse()
                .map_err(|e| Error::Schema(format!("a stored event's state: {e}")))?,
            attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
            last_error,
        })
    }

    /// Where the next page starts: after this event.
    fn cursor(&self) -> String {
        format!("{:x}.{:x}", micros(self.received_at), self.id)
    }
}

/// One page of a listing of events, and where the next one starts.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventPage {
    /// The events of this page, oldest first.
    pub events: Vec<Event>,
    /// The cursor of the next page ([`EventFilter::after`]); `None` on the last page.
    pub next: Option<String>,
    /// Where the window of a search by part of the key began when its filter set no
    /// start ([`EventFilter::key_contains`]): older events were not read.
    pub searched_since: Option<SystemTime>,
}

/// A stored event whole: its body and headers as stored, and its delivery attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventDetail {
    /// The event as a listing shows it.
    pub event: Event,
    /// The body, as received.
    pub payload: Vec<u8>,
    /// The headers delivered with it.
    pub headers: Vec<(String, String)>,
    /// Its last delivery attempts (at most 25), oldest first, replays' included: each
    /// replay counts its attempts from 1 again.
    pub attempts: Vec<Attempt>,
}

impl EventDetail {
    fn decode(row: EventDetailTuple) -> Result<Self, Error> {
        let (id, scope, key, origin, received, state, attempts, error, payload, headers, history) =
            row;
        let event = Event::decode((id, scope, key, origin, received, state, attempts, error))?;
        Ok(Self {
            event,
            payload,
            headers: parse_headers(&headers)?,
            attempts: history.map_or(Ok(Vec::new()), |json| Attempt::parse_history(&json))?,
        })
    }
}

/// The events of one source or consumer received within a window of time, to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayRange {
    origin: String,
    since: SystemTime,
    until: Option<SystemTime>,
}

impl ReplayRange {
    /// The events of `origin` received at or after `since`, up to now.
    pub fn new(origin: impl Into<String>, since: SystemTime) -> Self {
        Self {
            origin: origin.into(),
            since,
            until: None,
        }
    }

    /// Only the events received at or before `until`.
    pub fn until(mut self, until: SystemTime) -> Self {
        self.until = Some(until);
        self
    }

    fn new_replay(&self, id: i64) -> NewReplay<'_> {
        NewReplay {
            id,
            origin: &self.origin,
            since_us: micros(self.since),
            until_us: self.until.map(micros),
        }
    }
}

/// A replay of a time range, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayWindow {
    /// The replay's id.
    pub id: i64,
    /// The source or consumer whose events it replayed.
    pub origin: String,
    /// The events received from this time on.
    pub since: SystemTime,
    /// Up to this time: the one asked for, or when the replay began.
    pub until: SystemTime,
    /// When the replay began, by the store's clock.
    pub started_at: SystemTime,
    /// How many events it put back to be delivered again.
    pub events: u64,
    /// Whether some of them still wait for their delivery: a replay of an overlapping
    /// range is refused meanwhile.
    pub running: bool,
}

impl From<ReplayTuple> for ReplayWindow {
    fn from((id, origin, since, until, started, events, running): ReplayTuple) -> Self {
        Self {
            id,
            origin,
            since: time_of(since),
            until: time_of(until),
            started_at: time_of(started),
            events: u64::try_from(events).unwrap_or(0),
            running,
        }
    }
}

impl<DB: Backend> Outbox<DB> {
    /// A page of the stored events `filter` selects, oldest first.
    pub async fn events(&self, filter: &EventFilter) -> Result<EventPage, Error> {
        let limit = filter.limit.max(1);
        let searched_since = (filter.key_part.is_some() && filter.since.is_none()).then(|| {
            let end = filter.until.unwrap_or_else(SystemTime::now);
            end.checked_sub(KEY_CONTAINS_WINDOW)
                .unwrap_or(SystemTime::UNIX_EPOCH)
        });
        let listing = EventListing {
            origin: filter.origin.as_deref(),
            key_prefix: (filter.key_prefix.as_deref())
                .map(|prefix| (prefix, least_text_above_prefix(prefix))),
            key_part: filter.key_part.as_deref(),
            since_us: filter.since.or(searched_since).map(micros),
            until_us: filter.until.map(micros),
            state: filter.state.map(EventState::as_str),
            after: filter.after,
            // One more than asked for tells whether there is a next page.
            limit: i64::from(limit) + 1,
        };
        let rows = self.shared.sql.events(&self.shared.pool, listing).await?;
        let mut events = rows
            .into_iter()
            .map(Event::decode)
            .collect::<Result<Vec<_>, _>>()?;
        let more = events.len() > limit as usize;
        events.truncate(limit as usize);
        let next = more.then(|| events.last().map(Event::cursor)).flatten();
        Ok(EventPage {
            events,
            next,
            searched_since,
        })
    }

    /// One stored event whole, by id.
    pub async fn event(&self, id: i64) -> Result<Option<EventDetail>, Error> {
        let rows = self.event_details(EventBy::Id(id)).await?;
        Ok(rows.into_iter().next())
    }

    /// Every stored event written with `key`, whole, in the order written: one per
    /// destination the work wrote to, one for an event the service received.
    pub async fn events_with_key(&self, key: &str) -> Result<Vec<EventDetail>, Error> {
        self.event_details(EventBy::Key(key)).await
    }

    async fn event_details(&self, by: EventBy<'_>) -> Result<Vec<EventDetail>, Error> {
        let rows = self.shared.sql.event_details(&self.shared.pool, by).await?;
        rows.into_iter().map(EventDetail::decode).collect()
    }

    /// Puts a delivered or dead event back to be delivered again, with the same key, its
    /// attempts counted anew. Returns `false`, changing nothing, for an event that is not
    /// stored or already waits for a delivery.
    pub async fn replay_event(&self, id: i64) -> Result<bool, Error> {
        let replayed = self.change(Change::ReplayEvent { id }).await?;
        let origin = match replayed {
            0 => return Ok(false),
            _ => self.event(id).await?.map(|event| event.event.origin),
        };
        counted(origin.as_deref().unwrap_or_default(), "event", replayed);
        tracing::info!(id, origin = origin.as_deref(), "event replayed");
        Ok(true)
    }

    /// [`Outbox::replay_event`] for every delivered or dead event written with `key`;
    /// returns how many.
    pub async fn replay_key(&self, key: &str) -> Result<u64, Error> {
        // Read first, to count each replayed event under its origin.
        let before = self.events_with_key(key).await?;
        let replayed = self.change(Change::ReplayKey { key }).await?;
        if replayed > 0 {
            let picked = before.iter().filter(|e| e.event.state != EventState::Due);
            for shown in picked {
                counted(&shown.event.origin, "key", 1);
            }
            tracing::info!(key, replayed, "events replayed by key");
        }
        Ok(replayed)
    }

    /// How many events [`Outbox::replay_range`] would put back now: those of the range
    /// delivered or dead.
    pub async fn replayable(&self, range: &ReplayRange) -> Result<u64, Error> {
        let count = (self.shared.sql)
            .replayable(&self.shared.pool, range.new_replay(0))
            .await?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    /// Replays every delivered or dead event of the range, with the same keys, in one
    /// transaction, and records the replay. Events waiting for a delivery are left as they
    /// are: each is delivered once more at most.
    ///
    /// While an earlier replay of an overlapping range of the same origin still has events
    /// waiting, this one is refused with [`Error::ReplayRunning`], changing nothing.
    pub async fn replay_range(&self, range: &ReplayRange) -> Result<ReplayWindow, Error> {
        // Positive, so that an id reads the same wherever it is printed.
        let id = (random_u64() >> 1) as i64;
        let outcome = {
            let _writer = self.shared.queue_writer().await;
            (self.shared.sql)
                .replay_window(&self.shared.pool, range.new_replay(id))
                .await?
        };
        let events = outcome.map_err(|window| Error::ReplayRunning {
            origin: range.origin.clone(),
            window,
        })?;
        if events > 0 {
            self.shared.wake_relays_now().await;
        }
        counted(&range.origin, "range", events);
        tracing::info!(id, origin = %range.origin, events, "events replayed by time range");
        self.replay_window(id)
            .await?
            .ok_or_else(|| Error::Schema(format!("replay {id} was not recorded")))
    }

    /// One replay of a time range, as recorded.
    pub async fn replay_window(&self, id: i64) -> Result<Option<ReplayWindow>, Error> {
        Ok(self.replays_of(Replays::Id(id)).await?.into_iter().next())
    }

    /// The latest replays of time ranges, newest first, at most `limit`.
    pub async fn replay_windows(&self, limit: u32) -> Result<Vec<ReplayWindow>, Error> {
        self.replays_of(Replays::Latest(i64::from(limit))).await
    }

    async fn replays_of(&self, which: Replays) -> Result<Vec<ReplayWindow>, Error> {
        let rows = self.shared.sql.replays(&self.shared.pool, which).await?;
        Ok(rows.into_iter().map(ReplayWindow::from).collect())
    }

    /// Deletes the delivered events of `origin` received more than `older_than` ago (by
    /// the store's clock), `batch_size` per statement; returns how many. Events waiting
    /// for a delivery and dead letters stay.
    pub async fn purge_events(
        &self,
        origin: &str,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, Error> {
        in_batches(batch_size, |limit| {
            self.purge_events_batch(origin, older_than, u32::try_from(limit).unwrap_or(u32::MAX))
        })
        .await
    }

    /// One statement of [`Outbox::purge_events`]: deletes at most `batch_size` events and
    /// returns how many it did; fewer than `batch_size` means none are left.
    pub async fn purge_events_batch(
        &self,
        origin: &str,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, Error> {
        self.change(Change::PurgeEvents {
            origin,
            older_than_ms: millis(older_than),
            limit: i64::from(batch_size.max(1)),
        })
        .await
    }
}

/// Counts `events` replayed of `origin`, picked by `how`.
fn counted(origin: &str, how: &'static str, events: u64) {
    metrics::counter!(REPLAYED_EVENTS, "origin" => origin.to_owned(), "by" => how)
        .increment(events);
}

/// Microseconds since the Unix epoch; 0 before it.
fn micros(time: SystemTime) -> i64 {
    let since = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_micros()).unwrap_or(i64::MAX)
}

fn time_of(micros: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}

/// The least text greater than every text that starts with `prefix`, in the order of
/// code points (UTF-8's byte order, the keys' order in every store); `None` when every
/// character of `prefix` is the greatest there is.
fn least_text_above_prefix(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        // The next character, past the surrogates, which are none.
        if let Some(next) = (u32::from(last) + 1..=u32::from(char::MAX)).find_map(char::from_u32) {
            chars.push(next);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

/// A cursor as [`Event::cursor`] writes it: the time and id of the last event of a page.
fn parse_cursor(cursor: &str) -> Result<(i64, i64), Error> {
    let invalid = || Error::InvalidCursor(format!("{cursor:?} is not a cursor a listing gave"));
    let (time, id) = cursor.split_once('.').ok_or_else(invalid)?;
    let number = |hex: &str| i64::from_str_radix(hex, 16).ok().filter(|n| *n >= 0);
    Ok((
        number(time).ok_or_else(invalid)?,
        number(id).ok_or_else(invalid)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_as_written_and_nothing_else_passes() {
        let event = Event {
            id: 4_711,
            scope: String::new(),
            key: "shop:evt_1".to_owned(),
            origin: "shop".to_owned(),
            received_at: time_of(1_796_210_860_123_456),
            state: EventState::Delivered,
            attempts: 1,
            last_error: None,
        };
        assert_eq!(
            parse_cursor(&event.cursor()).unwrap(),
            (1_796_210_860_123_456, 4_711)
        );
        for bad in ["", "12", "x.1", "1.", "-1.2", "1.2.3"] {
            assert!(
                matches!(parse_cursor(bad), Err(Error::InvalidCursor(_))),
                "{bad:?} was taken"
            );
        }
    }

    #[test]
    fn the_text_above_a_prefix_is_the_least_greater_than_its_every_extension() {
        assert_eq!(
            least_text_above_prefix("order:1042").as_deref(),
            Some("order:1043")
        );
        assert_eq!(
            least_text_above_prefix("a\u{D7FF}").as_deref(),
            Some("a\u{E000}")
        );
        assert_eq!(least_text_above_prefix("a\u{10FFFF}").as_deref(), Some("b"));
        assert_eq!(least_text_above_prefix("\u{10FFFF}"), None);
        assert_eq!(least_text_above_prefix(""), None);
        let above = least_text_above_prefix("ab").unwrap();
        for extension in ["ab", "ab ", "ab\u{10FFFF}\u{10FFFF}", "abzzz"] {
            assert!(extension < above.as_str(), "{extension:?}");
        }
        assert!("ac" >= above.as_str());
    }

    #[test]
    fn states_read_back_from_their_names() {
        for state in EventState::ALL {
            assert_eq!(state.as_str().parse::<EventState>(), Ok(state));
        }
        assert!("sent".parse::<EventState>().is_err());
    }
}
