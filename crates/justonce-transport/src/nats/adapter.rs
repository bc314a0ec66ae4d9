//! The NATS JetStream adapter of the consumer: a durable pull consumer's messages, and
//! how it settles them.

use super::connection::{broker, connected, dead_letter, open_stream};
use super::options::{MSG_ID_HEADER, NatsOptions};
use crate::consumer::{Broker, Receive, Received, Settle};
use crate::reader::retry_delay;
use crate::{Error, Policy};
use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use justonce_sql::{Backend, Inbox};
use std::future::Future;
use std::time::Duration;

/// A NATS JetStream consumer that runs each message's work once in effect.
pub type NatsConsumer<DB> = crate::Consumer<Nats, DB>;

/// The NATS JetStream adapter of [`NatsConsumer`]: a durable pull consumer.
pub struct Nats {
    jetstream: jetstream::Context,
    consumer: jetstream::consumer::Consumer<pull::Config>,
    options: NatsOptions,
}

debug_shows_options!(Nats);

impl<DB: Backend> NatsConsumer<DB> {
    /// Connects to `url` (one server, or a cluster's servers separated by commas), creates
    /// the streams unless they exist elsewhere, and binds the durable pull consumer
    /// (explicit acks, no delivery limit of its own: this consumer counts attempts and
    /// dead-letters).
    pub async fn connect(url: &str, inbox: Inbox<DB>, options: NatsOptions) -> Result<Self, Error> {
        let (jetstream, stream) = open_stream(url, &options).await?;
        let consumer = stream
            .get_or_create_consumer(
                &options.durable,
                pull::Config {
                    durable_name: Some(options.durable.clone()),
                    filter_subject: options.subject.clone(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: options.ack_wait,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| Error::Config(format!("consumer {}: {e}", options.durable)))?;
        let nats = Nats {
            jetstream,
            consumer,
            options,
        };
        Ok(Self::new(nats, inbox))
    }
}

/// The messages of one pull consumer: a durable one, or the ordered one of a
/// [`NatsReader`](super::NatsReader).
pub struct Messages<S = pull::Stream> {
    pub(super) stream: S,
}

impl<S, E> Receive for Messages<S>
where
    S: futures_util::Stream<Item = Result<jetstream::Message, E>> + Unpin + Send,
    E: std::error::Error + Send + Sync + 'static,
{
    type Delivery = jetstream::Message;

    async fn next(&mut self) -> Result<Option<jetstream::Message>, Error> {
        self.stream.next().await.transpose().map_err(broker)
    }
}

impl Received for jetstream::Message {
    fn message_id(&self) -> Result<String, String> {
        self.header(MSG_ID_HEADER)
            .ok_or_else(|| "the message has no Nats-Msg-Id header".to_owned())
    }

    fn header(&self, name: &str) -> Option<String> {
        let value = self.headers.as_ref()?.get(name)?;
        Some(value.as_str().to_owned())
    }

    fn no_header(&self, name: &str) -> String {
        format!("the message has no header {name}")
    }

    fn log_id(&self) -> String {
        format!("subject {}", self.subject)
    }

    fn body(&self) -> Vec<u8> {
        self.payload.to_vec()
    }

    fn content_type(&self) -> Option<String> {
        self.header("Content-Type")
    }

    /// As the server counts deliveries.
    fn attempt(&self) -> u32 {
        self.info()
            .map(|info| u32::try_from(info.delivered).unwrap_or(1).max(1))
            .unwrap_or(1)
    }
}

impl Broker for Nats {
    type Delivery = jetstream::Message;
    type Receiver<'b> = Messages;
    const NAME: &'static str = "nats";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    async fn receive(&self) -> Result<Messages, Error> {
        // A consumer made elsewhere may cap its pulls lower; the server refuses a larger one.
        let max_batch = usize::try_from(self.consumer.cached_info().config.max_batch)
            .ok()
            .filter(|&max| max > 0);
        let prefetch =
            max_batch.map_or(self.options.prefetch, |max| self.options.prefetch.min(max));
        let stream = self
            .consumer
            .stream()
            .max_messages_per_batch(prefetch)
            // The client's default, which a stream built by hand leaves off: a pull the
            // server lost is noticed in seconds, not at its expiry.
            .heartbeat(Duration::from_secs(15))
            .messages()
            .await
            .map_err(broker)?;
        Ok(Messages { stream })
    }

    async fn reconnect(&self) -> Result<(), Error> {
        connected(&self.jetstream)
    }

    /// A retry is a NAK with a growing delay, counted by the server; a dead letter is
    /// published, then the original terminated; given back is a NAK without delay.
    async fn settle(&self, message: &jetstream::Message, settle: Settle) -> Result<(), Error> {
        let kind = match settle {
            Settle::Ack => AckKind::Ack,
            Settle::Retry { attempt } => AckKind::Nak(Some(retry_delay(attempt))),
            Settle::DeadLetter { attempt, reason } => {
                dead_letter(&self.jetstream, &self.options, message, attempt, &reason).await?;
                AckKind::Term
            }
            Settle::GiveBack => AckKind::Nak(None),
        };
        message.ack_with(kind).await.map_err(Error::Broker)
    }

    /// Tells the server every half ack wait that `messages` are in progress, so that long
    /// work is not redelivered to another reader.
    async fn working<T: Send>(
        &self,
        messages: &[&jetstream::Message],
        work: impl Future<Output = T> + Send,
    ) -> T {
        let mut work = std::pin::pin!(work);
        // The first report is due after half the ack wait. An interval's immediate first
        // tick would cost a turn of the timer wheel (up to a millisecond) on every message.
        let every = self.options.ack_wait / 2;
        let mut progress = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                done = &mut work => return done,
                _ = progress.tick() => {
                    for message in messages {
                        // A lost progress report costs at most a redelivery, which is a
                        // duplicate.
                        let _ = message.ack_with(AckKind::Progress).await;
                    }
                }
            }
        }
    }
}
