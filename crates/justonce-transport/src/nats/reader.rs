//! The NATS JetStream adapter of the single reader: a stream read through ordered consumers.

use super::adapter::Messages;
use super::connection::{broker, connected, dead_letter, open_stream};
use super::options::NatsOptions;
use crate::reader::PARTITION;
use crate::{Error, OrderedBroker, Policy, Position, StoredOffsets};
use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::{self};
use justonce_sql::{Backend, Inbox, Offset};

/// A single reader of a JetStream subject that keeps its position in the database: each
/// message's stream sequence is stored as an offset in the same transaction as its work, and
/// the reader starts after the stored one. The server keeps no acknowledgement state: the
/// messages come through an ordered consumer, which the server forgets when the reader
/// goes.
///
/// Use it where one process reads a subject in order; readers that share the messages need
/// [`NatsConsumer`](super::NatsConsumer). It is the generic [`Reader`](crate::Reader) over
/// [`NatsStream`]: failed work runs again in place, up to the attempt limit, then goes to
/// the dead-letter subject with its reason. The durable name and the ack wait of
/// [`NatsOptions`] do not apply.
pub type NatsReader<DB> = crate::Reader<NatsStream, DB>;

/// The NATS JetStream adapter of [`NatsReader`]: a stream read through ordered consumers.
#[derive(Debug)]
pub struct NatsStream {
    jetstream: jetstream::Context,
    stream: jetstream::stream::Stream,
    /// See [`NatsReader::offset_stream`].
    offset_stream: String,
    options: NatsOptions,
}

impl<DB: Backend> NatsReader<DB> {
    /// Connects to `url` (one server, or a cluster's servers separated by commas) and
    /// creates the streams unless they exist elsewhere.
    pub async fn connect(url: &str, inbox: Inbox<DB>, options: NatsOptions) -> Result<Self, Error> {
        let (jetstream, stream) = open_stream(url, &options).await?;
        let nats = NatsStream {
            jetstream,
            stream,
            offset_stream: format!("{}:{}", options.stream, options.subject),
            options,
        };
        Ok(Self::new(nats, inbox))
    }

    /// The name the position is stored under for the inbox's consumer: the stream and the
    /// subject, such as `ORDERS:orders.*`, since two subjects of one stream are read apart.
    pub fn offset_stream(&self) -> &str {
        &self.broker().offset_stream
    }
}

impl OrderedBroker for NatsStream {
    type Entry = jetstream::Message;
    type Entries<'b> = Messages<pull::Ordered>;
    const NAME: &'static str = "nats";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    async fn read(&self, stored: StoredOffsets) -> Result<Messages<pull::Ordered>, Error> {
        let deliver_policy = match stored.offset(&self.offset_stream, PARTITION).await? {
            Some(offset) => DeliverPolicy::ByStartSequence {
                start_sequence: u64::try_from(offset.position).unwrap_or(0) + 1,
            },
            None => DeliverPolicy::All,
        };
        let consumer = self
            .stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: self.options.subject.clone(),
                deliver_policy,
                ..Default::default()
            })
            .await
            .map_err(|e| {
                use async_nats::jetstream::stream::ConsumerErrorKind as Kind;
                // A server not answering yet, as after a restart, is a lost connection; a
                // refusal is the configuration's.
                match e.kind() {
                    Kind::TimedOut | Kind::Request => broker(e),
                    _ => Error::Config(format!("reading stream {}: {e}", self.options.stream)),
                }
            })?;
        let stream = consumer.messages().await.map_err(broker)?;
        Ok(Messages { stream })
    }

    async fn reconnect(&self) -> Result<(), Error> {
        connected(&self.jetstream)
    }

    fn position<'e>(&'e self, message: &'e jetstream::Message) -> Result<Position<'e>, String> {
        let info = message
            .info()
            .map_err(|e| format!("the message has no stream position: {e}"))?;
        Ok(Position {
            stream: &self.offset_stream,
            partition: PARTITION,
            offset: Offset::from(i64::try_from(info.stream_sequence).unwrap_or(i64::MAX)),
        })
    }

    async fn dead_letter(
        &self,
        message: &jetstream::Message,
        attempt: u32,
        reason: &str,
    ) -> Result<(), Error> {
        dead_letter(&self.jetstream, &self.options, message, attempt, reason).await
    }
}
