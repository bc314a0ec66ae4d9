//! The Redis Streams adapter: a group member's entries, read and settled.

use super::connection::{broker, connect};
use super::options::{BODY_FIELD, CONTENT_TYPE_FIELD, KEY_FIELD, RedisStreamOptions};
use crate::consumer::{Broker, Receive, Received, Settle};
use crate::{ATTEMPT_HEADER, Error, Policy, REASON_BYTES, REASON_HEADER, truncate};
use justonce_sql::{Backend, Inbox, Offset};
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use redis::streams::{StreamAutoClaimOptions, StreamId, StreamReadOptions, StreamReadReply};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How long one read waits for new entries before the reader looks at the pending list
/// and its shutdown again.
pub(super) const READ_BLOCK: Duration = Duration::from_millis(1_000);

/// A Redis Streams consumer group reader that runs each entry's work once in effect.
pub type RedisStreamConsumer<DB> = crate::Consumer<RedisStreams, DB>;

/// The Redis Streams adapter of [`RedisStreamConsumer`], a member of a consumer group, and
/// of [`RedisStreamReader`](super::RedisStreamReader), a single reader.
pub struct RedisStreams {
    pub(super) url: String,
    /// The connection that acknowledges and dead-letters, replaced when the consumer or the
    /// reader connects again; each read has one of its own.
    pub(super) redis: std::sync::Mutex<MultiplexedConnection>,
    pub(super) options: RedisStreamOptions,
}

debug_shows_options!(RedisStreams);

/// One entry taken from the stream, with the delivery Redis counts.
#[derive(Debug)]
pub struct Entry {
    entry: StreamId,
    attempt: u32,
}

impl Entry {
    /// The entry's id in the stream.
    pub fn id(&self) -> &str {
        &self.entry.id
    }

    /// Which delivery of the entry this is, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The value of one of the entry's fields.
    pub fn field(&self, name: &str) -> Option<Vec<u8>> {
        self.entry.get::<Vec<u8>>(name)
    }
}

impl<DB: Backend> RedisStreamConsumer<DB> {
    /// Connects to `url` and creates the group (and the stream) unless it exists.
    pub async fn connect(
        url: &str,
        inbox: Inbox<DB>,
        options: RedisStreamOptions,
    ) -> Result<Self, Error> {
        let mut redis = connect(url, options.tls.as_ref()).await?;
        create_group(&mut redis, &options).await?;
        Ok(Self::new(RedisStreams::new(url, redis, options), inbox))
    }
}

/// Creates the group (and the stream) unless it exists. A refusal is a setting to fix; a
/// connection lost meanwhile, or a server still loading its data, is not.
async fn create_group(
    redis: &mut MultiplexedConnection,
    options: &RedisStreamOptions,
) -> Result<(), Error> {
    let created: redis::RedisResult<()> = redis
        .xgroup_create_mkstream(&options.stream, &options.group, "0")
        .await;
    match created {
        Ok(()) => Ok(()),
        Err(error) if error.code() == Some("BUSYGROUP") => Ok(()),
        Err(error) if error.code().is_none_or(|code| code == "LOADING") => Err(broker(error)),
        Err(error) => Err(Error::Config(format!(
            "creating group {} on stream {}: {error}",
            options.group, options.stream
        ))),
    }
}

impl Received for Entry {
    fn message_id(&self) -> Result<String, String> {
        self.header(KEY_FIELD)
            .ok_or_else(|| self.no_header(KEY_FIELD))
    }

    fn header(&self, name: &str) -> Option<String> {
        String::from_utf8(self.field(name)?).ok()
    }

    fn no_header(&self, name: &str) -> String {
        match self.field(name) {
            Some(_) => format!("the field {name} is not UTF-8"),
            None => format!("the entry has no field {name}"),
        }
    }

    fn log_id(&self) -> String {
        format!("entry {}", self.id())
    }

    fn body(&self) -> Vec<u8> {
        self.field(BODY_FIELD).unwrap_or_default()
    }

    fn content_type(&self) -> Option<String> {
        self.header(CONTENT_TYPE_FIELD)
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }
}

impl Broker for RedisStreams {
    type Delivery = Entry;
    type Receiver<'b> = Entries<'b>;
    const NAME: &'static str = "redis";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    /// On a connection of its own: a read blocks the connection for up to a second, and
    /// the consumer acknowledges a batch while it reads the next.
    async fn receive(&self) -> Result<Entries<'_>, Error> {
        let reading = connect(&self.url, self.options.tls.as_ref()).await?;
        Ok(self.entries(reading, Cursor::Group { last_claim: None }))
    }

    /// A new connection, and the group made again if the server lost it.
    async fn reconnect(&self) -> Result<(), Error> {
        let mut redis = connect(&self.url, self.options.tls.as_ref()).await?;
        create_group(&mut redis, &self.options).await?;
        *crate::lock(&self.redis) = redis;
        Ok(())
    }

    /// A retry, or an entry given back, is left pending: a reader takes it over after the
    /// claim idle time. A dead letter is added to the dead-letter stream and acknowledged
    /// in one transaction on the server.
    async fn settle(&self, entry: &Entry, settle: Settle) -> Result<(), Error> {
        match settle {
            Settle::Ack => self.ack_all(&[entry], &mut 0).await,
            Settle::Retry { .. } | Settle::GiveBack => Ok(()),
            Settle::DeadLetter { attempt, reason } => {
                let mut redis = self.redis();
                redis::pipe()
                    .atomic()
                    .xadd(
                        self.options.dead_letter_stream(),
                        "*",
                        &dead_letter_fields(entry, attempt, &reason),
                    )
                    .ignore()
                    .xack(&self.options.stream, &self.options.group, &[entry.id()])
                    .ignore()
                    .query_async::<()>(&mut redis)
                    .await
                    .map_err(broker)
            }
        }
    }

    /// One `XACK` for them all.
    async fn ack_all(&self, entries: &[&Entry], acked: &mut u64) -> Result<(), Error> {
        if entries.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = entries.iter().map(|entry| entry.id()).collect();
        let mut redis = self.redis();
        let _: usize = redis
            .xack(&self.options.stream, &self.options.group, &ids)
            .await
            .map_err(broker)?;
        *acked += entries.len() as u64;
        Ok(())
    }
}

impl RedisStreams {
    pub(super) fn new(
        url: &str,
        redis: MultiplexedConnection,
        options: RedisStreamOptions,
    ) -> Self {
        Self {
            url: url.to_owned(),
            redis: std::sync::Mutex::new(redis),
            options,
        }
    }

    /// The connection in use.
    pub(super) fn redis(&self) -> MultiplexedConnection {
        crate::lock(&self.redis).clone()
    }

    /// The entries from `cursor` on, read through `redis`.
    pub(super) fn entries(&self, redis: MultiplexedConnection, cursor: Cursor) -> Entries<'_> {
        Entries {
            streams: self,
            redis,
            cursor,
            read: VecDeque::new(),
        }
    }
}

/// An entry's fields, with the attempt it was given up on and why.
pub(super) fn dead_letter_fields(
    entry: &Entry,
    attempt: u32,
    reason: &str,
) -> Vec<(String, Vec<u8>)> {
    let mut fields: Vec<(String, Vec<u8>)> = entry
        .entry
        .map
        .keys()
        .filter_map(|name| Some((name.clone(), entry.field(name)?)))
        .collect();
    fields.push((ATTEMPT_HEADER.to_owned(), attempt.to_string().into()));
    fields.push((
        REASON_HEADER.to_owned(),
        truncate(reason, REASON_BYTES).as_bytes().to_vec(),
    ));
    fields
}

/// `justonce-<host>-<pid>`, or `justonce-<pid>` where the host name cannot be read: the
/// host tells apart containers, whose processes often all have pid 1.
pub(super) fn own_consumer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|host| host.trim().to_owned())
        .filter(|host| !host.is_empty());
    match host {
        Some(host) => format!("justonce-{host}-{}", std::process::id()),
        None => format!("justonce-{}", std::process::id()),
    }
}

/// The offset of an entry id `<ms>-<seq>`.
pub(super) fn offset_of(id: &str) -> Option<Offset> {
    let (ms, seq) = id.split_once('-')?;
    Some(Offset::new(ms.parse().ok()?, seq.parse().ok()?))
}

/// Where a reader of the stream takes entries from.
pub(super) enum Cursor {
    /// As a member of the group: first what other members left pending past the claim idle
    /// time (looked at when this was last done), then new ones.
    Group { last_claim: Option<Instant> },
    /// After this entry id, with no group: a single reader.
    After(String),
}

/// The entries of one member of a group, or of a single reader, in the order read.
pub struct Entries<'c> {
    streams: &'c RedisStreams,
    redis: MultiplexedConnection,
    cursor: Cursor,
    /// The entries of the last read not yet taken.
    read: VecDeque<Entry>,
}

impl Receive for Entries<'_> {
    type Delivery = Entry;

    async fn next(&mut self) -> Result<Option<Entry>, Error> {
        while self.read.is_empty() {
            self.read = self.read().await?.into();
        }
        Ok(self.read.pop_front())
    }

    /// The entries of the same read: a batch waits for no other.
    async fn more(&mut self, first: Entry, batch_size: usize) -> Result<Vec<Entry>, Error> {
        let more = batch_size.saturating_sub(1).min(self.read.len());
        Ok(std::iter::once(first)
            .chain(self.read.drain(..more))
            .collect())
    }
}

impl Entries<'_> {
    /// Pending entries taken over, or new ones; none when none came within a second.
    async fn read(&mut self) -> Result<Vec<Entry>, Error> {
        let options = &self.streams.options;
        let read = StreamReadOptions::default()
            .count(options.count)
            .block(usize::try_from(READ_BLOCK.as_millis()).unwrap_or(1_000));
        let (read, after) = match &self.cursor {
            Cursor::After(after) => (read, after.clone()),
            Cursor::Group { last_claim } => {
                // Looked at every half of the idle time: a pending entry waits at most 1.5
                // times it.
                if last_claim.is_none_or(|at| at.elapsed() >= options.claim_idle / 2) {
                    let claimed = self.claim_pending().await?;
                    if !claimed.is_empty() {
                        return Ok(claimed);
                    }
                    self.cursor = Cursor::Group {
                        last_claim: Some(Instant::now()),
                    };
                }
                (
                    read.group(&options.group, &options.consumer),
                    ">".to_owned(),
                )
            }
        };
        let reply: Option<StreamReadReply> = self
            .redis
            .xread_options(&[&options.stream], &[&after], &read)
            .await
            .map_err(broker)?;
        let entries = entries_of(reply);
        if let (Cursor::After(after), Some(last)) = (&mut self.cursor, entries.last()) {
            last.id().clone_into(after);
        }
        Ok(entries)
    }

    /// Takes over entries pending longer than the claim idle time, with the delivery count
    /// Redis keeps for each.
    async fn claim_pending(&mut self) -> Result<Vec<Entry>, Error> {
        let options = &self.streams.options;
        let idle = u64::try_from(options.claim_idle.as_millis()).unwrap_or(u64::MAX);
        let claimed: redis::streams::StreamAutoClaimReply = self
            .redis
            .xautoclaim_options(
                &options.stream,
                &options.group,
                &options.consumer,
                idle,
                "0-0",
                StreamAutoClaimOptions::default().count(options.count),
            )
            .await
            .map_err(broker)?;
        let mut entries = Vec::with_capacity(claimed.claimed.len());
        for entry in claimed.claimed {
            let pending: redis::streams::StreamPendingCountReply = self
                .redis
                .xpending_count(&options.stream, &options.group, &entry.id, &entry.id, 1)
                .await
                .map_err(broker)?;
            let delivered = pending.ids.first().map_or(1, |p| p.times_delivered);
            entries.push(Entry {
                entry,
                attempt: u32::try_from(delivered).unwrap_or(u32::MAX).max(1),
            });
        }
        Ok(entries)
    }
}

/// The entries of a read, each on its first delivery.
fn entries_of(reply: Option<StreamReadReply>) -> Vec<Entry> {
    reply
        .into_iter()
        .flat_map(|reply| reply.keys)
        .flat_map(|stream| stream.ids)
        .map(|entry| Entry { entry, attempt: 1 })
        .collect()
}

#[cfg(test)]
mod tests {
    /// Two containers whose processes both have pid 1 differ by their host names.
    #[test]
    fn the_default_consumer_name_holds_the_host_and_the_pid() {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("a host name");
        assert_eq!(
            super::own_consumer_name(),
            format!("justonce-{}-{}", host.trim(), std::process::id())
        );
    }
}
