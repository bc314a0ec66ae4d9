//! The Redis Streams adapter of the single reader.

use super::adapter::{Cursor, Entries, Entry, RedisStreams, dead_letter_fields, offset_of};
use super::connection::{broker, connect};
use super::options::RedisStreamOptions;
use crate::reader::PARTITION;
use crate::{Error, OrderedBroker, Policy, Position, StoredOffsets};
use justonce_sql::{Backend, Inbox};
use redis::AsyncCommands;

/// A single reader of a stream that keeps its position in the database: each entry's id
/// is stored as an offset in the same transaction as its work, and the reader starts after
/// the stored one. It reads with plain `XREAD`: no group, nothing pending, nothing to
/// acknowledge.
///
/// Use it where one process reads a stream in order; readers that share the entries need
/// [`RedisStreamConsumer`](super::RedisStreamConsumer). It is the generic
/// [`Reader`](crate::Reader) over [`RedisStreams`]: failed work runs again in place, up to
/// the attempt limit, then goes to `<stream>.dead` with its reason. The group, the consumer
/// name and the claim idle time of [`RedisStreamOptions`] do not apply.
pub type RedisStreamReader<DB> = crate::Reader<RedisStreams, DB>;

impl<DB: Backend> RedisStreamReader<DB> {
    /// Connects to `url`.
    pub async fn connect(
        url: &str,
        inbox: Inbox<DB>,
        options: RedisStreamOptions,
    ) -> Result<Self, Error> {
        let redis = connect(url, options.tls.as_ref()).await?;
        Ok(Self::new(RedisStreams::new(url, redis, options), inbox))
    }

    /// The name the position is stored under for the inbox's consumer: the stream's.
    pub fn offset_stream(&self) -> &str {
        &self.broker().options.stream
    }
}

/// A single reader reads with `XREAD` after the last entry it read; a dead letter is added
/// to the dead-letter stream.
impl OrderedBroker for RedisStreams {
    type Entry = Entry;
    type Entries<'b> = Entries<'b>;
    const NAME: &'static str = "redis";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    /// On a connection of its own, as [`Broker::receive`](crate::Broker::receive): a read
    /// blocks its connection for up to a second, and a dead letter is added while the next
    /// batch is read.
    async fn read(&self, stored: StoredOffsets) -> Result<Entries<'_>, Error> {
        let after = (stored.offset(&self.options.stream, PARTITION).await?).unwrap_or_default();
        let cursor = Cursor::After(format!("{}-{}", after.position, after.sequence));
        let reading = connect(&self.url, self.options.tls.as_ref()).await?;
        Ok(self.entries(reading, cursor))
    }

    /// A new connection for dead letters; the next read, on one of its own, starts after
    /// the stored offset.
    async fn reconnect(&self) -> Result<(), Error> {
        let redis = connect(&self.url, self.options.tls.as_ref()).await?;
        *crate::lock(&self.redis) = redis;
        Ok(())
    }

    fn position<'e>(&'e self, entry: &'e Entry) -> Result<Position<'e>, String> {
        let offset = offset_of(entry.id())
            .ok_or_else(|| format!("the entry id {} is not <ms>-<seq>", entry.id()))?;
        Ok(Position {
            stream: &self.options.stream,
            partition: PARTITION,
            offset,
        })
    }

    async fn dead_letter(&self, entry: &Entry, attempt: u32, reason: &str) -> Result<(), Error> {
        let mut redis = self.redis();
        redis
            .xadd::<_, _, _, _, String>(
                self.options.dead_letter_stream(),
                "*",
                &dead_letter_fields(entry, attempt, reason),
            )
            .await
            .map(drop)
            .map_err(broker)
    }
}
