//! The RabbitMQ adapter: its receiver, its deliveries and how it settles them.

use super::connection::{
    Open, broker, channel_closed, open, publish, taken, while_open, within_goodbye_wait,
};
use super::options::{AmqpOptions, QueueType};
use crate::consumer::{Broker, Receive, Received, Settle};
use crate::{ATTEMPT_HEADER, Error, Policy, REASON_BYTES, REASON_HEADER, truncate};
use futures_util::{FutureExt, StreamExt};
use justonce_sql::{Backend, Inbox};
use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable};
use std::sync::Arc;

/// Set by a quorum queue on a delivery it gave before: how many times it was given back
/// or lost with its consumer.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// A RabbitMQ consumer that runs each delivery's work once in effect.
pub type AmqpConsumer<DB> = crate::Consumer<Amqp, DB>;

/// The RabbitMQ adapter of [`AmqpConsumer`]: a channel with publisher confirms (for
/// retries and dead letters) and the prefetch.
pub struct Amqp {
    url: String,
    /// The connection, its channel and the channel's deliveries not settled, replaced
    /// together when the consumer connects again.
    open: std::sync::Mutex<Open>,
    options: AmqpOptions,
}

debug_shows_options!(Amqp);

impl<DB: Backend> AmqpConsumer<DB> {
    /// Connects to `url` and prepares the channel: publisher confirms (for retries and dead
    /// letters), the prefetch, and the queues unless they are declared elsewhere.
    pub async fn connect(url: &str, inbox: Inbox<DB>, options: AmqpOptions) -> Result<Self, Error> {
        let open = open(url, &options).await?;
        let amqp = Amqp {
            url: url.to_owned(),
            open: std::sync::Mutex::new(open),
            options,
        };
        Ok(Self::new(amqp, inbox))
    }
}

/// The deliveries of one `basic.consume`.
pub struct AmqpReceiver {
    channel: Channel,
    unsettled: Arc<Unsettled>,
    consumer: lapin::Consumer,
    tag: String,
}

impl Receive for AmqpReceiver {
    type Delivery = AmqpDelivery;

    /// An end of the deliveries on a channel that closed is a lost connection, not the
    /// broker ending the consumer.
    async fn next(&mut self) -> Result<Option<Self::Delivery>, Error> {
        let next = while_open(&self.channel, self.consumer.next().map(Option::transpose)).await?;
        if next.is_none() && !self.channel.status().connected() {
            return Err(channel_closed());
        }
        Ok(next.map(|delivery| {
            crate::lock(&self.unsettled.tags).insert(delivery.delivery_tag);
            AmqpDelivery {
                delivery,
                unsettled: Arc::clone(&self.unsettled),
            }
        }))
    }

    async fn stop(self) -> Result<(), Error> {
        let cancel = self
            .channel
            .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default());
        while_open(&self.channel, cancel).await
    }
}

/// A delivery of the consumer's channel. It derefs to lapin's delivery: its body, its
/// properties, its tag. Settle it through the consumer (`settle`, `settle_batch`): one
/// acknowledged through lapin directly stays unsettled to the consumer, and the later
/// batches of its channel go back to an acknowledgement per delivery.
pub struct AmqpDelivery {
    delivery: lapin::message::Delivery,
    /// Its channel's deliveries not settled yet.
    unsettled: Arc<Unsettled>,
}

impl std::ops::Deref for AmqpDelivery {
    type Target = lapin::message::Delivery;

    fn deref(&self) -> &lapin::message::Delivery {
        &self.delivery
    }
}

impl std::fmt::Debug for AmqpDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.delivery.fmt(f)
    }
}

/// The tags of a channel's deliveries handed to the consumer and not yet settled. A tag
/// leaves only once its settlement is written, so that one `multiple` acknowledgement never
/// covers a delivery with another settlement on its way.
#[derive(Default)]
pub(super) struct Unsettled {
    tags: std::sync::Mutex<std::collections::BTreeSet<u64>>,
}

impl Unsettled {
    /// The delivery whose `multiple` acknowledgement settles exactly `deliveries`: all
    /// from this channel, and no other delivery of it unsettled below the highest tag.
    fn one_ack_for<'d>(
        self: &Arc<Self>,
        deliveries: &[&'d AmqpDelivery],
    ) -> Option<&'d AmqpDelivery> {
        if !(deliveries.iter()).all(|delivery| Arc::ptr_eq(&delivery.unsettled, self)) {
            return None;
        }
        let tags: Vec<u64> = deliveries
            .iter()
            .map(|delivery| delivery.delivery_tag)
            .collect();
        let last = one_ack_tag(&crate::lock(&self.tags), &tags)?;
        deliveries
            .iter()
            .find(|delivery| delivery.delivery_tag == last)
            .copied()
    }

    fn settled(&self, deliveries: &[&AmqpDelivery]) {
        let mut tags = crate::lock(&self.tags);
        for delivery in deliveries {
            tags.remove(&delivery.delivery_tag);
        }
    }
}

/// The tag whose `multiple` acknowledgement settles exactly `batch`, two deliveries or
/// more of a channel whose unsettled tags are `unsettled`: every one of them unsettled, and
/// no other unsettled below the highest.
fn one_ack_tag(unsettled: &std::collections::BTreeSet<u64>, batch: &[u64]) -> Option<u64> {
    let last = *batch.iter().max()?;
    let below = unsettled.range(..=last).count();
    let all_unsettled = batch.iter().all(|tag| unsettled.contains(tag));
    (batch.len() >= 2 && below == batch.len() && all_unsettled).then_some(last)
}

impl Received for AmqpDelivery {
    fn message_id(&self) -> Result<String, String> {
        self.properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .ok_or_else(|| "the message has no message_id".to_owned())
    }

    fn header(&self, name: &str) -> Option<String> {
        let headers = self.properties.headers().as_ref()?.inner();
        match headers.get(name)? {
            AMQPValue::LongString(text) => String::from_utf8(text.as_bytes().to_vec()).ok(),
            AMQPValue::ShortString(text) => Some(text.as_str().to_owned()),
            AMQPValue::LongLongInt(n) => Some(n.to_string()),
            AMQPValue::LongInt(n) => Some(n.to_string()),
            _ => None,
        }
    }

    fn no_header(&self, name: &str) -> String {
        let headers = self.properties.headers().as_ref().map(FieldTable::inner);
        match headers.and_then(|headers| headers.get(name)) {
            Some(AMQPValue::LongString(_)) => format!("header {name} is not UTF-8"),
            _ => format!("the message has no text header {name}"),
        }
    }

    fn log_id(&self) -> String {
        format!("delivery tag {}", self.delivery_tag)
    }

    fn body(&self) -> Vec<u8> {
        self.data.clone()
    }

    fn content_type(&self) -> Option<String> {
        (self.properties.content_type().as_ref())
            .map(|content_type| content_type.as_str().to_owned())
    }

    /// The attempts counted by the consumer's own header (each failed run publishes the
    /// next), plus those a quorum queue counted: deliveries given back, or lost when their
    /// consumer died before it settled them.
    fn attempt(&self) -> u32 {
        let counted = |name| self.header(name).and_then(|n| n.parse::<u32>().ok());
        let failed_runs = counted(ATTEMPT_HEADER).unwrap_or(1).max(1);
        failed_runs.saturating_add(counted(DELIVERY_COUNT_HEADER).unwrap_or(0))
    }

    /// The broker's `redelivered` flag, or an attempt the consumer published again after
    /// a failed run.
    fn redelivered(&self) -> bool {
        self.redelivered || self.attempt() > 1
    }
}

impl Broker for Amqp {
    type Delivery = AmqpDelivery;
    type Receiver<'b> = AmqpReceiver;
    const NAME: &'static str = "amqp";

    fn policy(&self) -> &Policy {
        &self.options.policy
    }

    /// Waits at most 5 s for each goodbye: a close marks the channel closing at once, so
    /// the watch of the other calls, which fail once it is not open, cannot be used.
    async fn close(&self) -> Result<(), Error> {
        let (connection, channel, _) = self.open();
        within_goodbye_wait(channel.close(200, "bye".into())).await?;
        within_goodbye_wait(connection.close(200, "bye".into())).await
    }

    async fn receive(&self) -> Result<AmqpReceiver, Error> {
        let (_, channel, unsettled) = self.open();
        let tag = format!("justonce-{}", std::process::id());
        let consume = channel.basic_consume(
            self.options.queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        );
        let consumer = while_open(&channel, consume).await?;
        Ok(AmqpReceiver {
            channel,
            unsettled,
            consumer,
            tag,
        })
    }

    /// A new connection and channel, prepared as at connect. The one lost is dropped.
    async fn reconnect(&self) -> Result<(), Error> {
        let open = open(&self.url, &self.options).await?;
        *crate::lock(&self.open) = open;
        Ok(())
    }

    /// A retry or a dead letter is a copy published, confirmed, then the original
    /// acknowledged: if this process dies in between, both copies exist, and the key makes
    /// the second one a duplicate. Given back is a requeueing nack.
    async fn settle(&self, delivery: &Self::Delivery, settle: Settle) -> Result<(), Error> {
        let options = &self.options;
        let (_, channel, _) = self.open();
        match settle {
            Settle::Ack => {}
            Settle::Retry { attempt } => {
                self.publish_copy(&channel, delivery, &options.queue, attempt + 1, None)
                    .await?;
            }
            Settle::DeadLetter { attempt, reason } => {
                let queue = &options.dead_letter_queue;
                self.publish_copy(&channel, delivery, queue, attempt, Some(&reason))
                    .await?;
            }
            // A quorum queue would count a requeue as a delivery failed: a database outage
            // would use up the message's attempts. A copy at the same attempt is not counted.
            Settle::GiveBack if options.queue_type == QueueType::Quorum => {
                let attempt = delivery.attempt();
                self.publish_copy(&channel, delivery, &options.queue, attempt, None)
                    .await?;
            }
            Settle::GiveBack => {
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                taken(while_open(&channel, delivery.nack(requeue)).await?)?;
                delivery.unsettled.settled(&[delivery]);
                return Ok(());
            }
        }
        taken(while_open(&channel, delivery.ack(BasicAckOptions::default())).await?)?;
        delivery.unsettled.settled(&[delivery]);
        Ok(())
    }

    /// A batch that holds every delivery of its channel not settled up to its highest tag
    /// is acknowledged with one `multiple` acknowledgement of that tag: one frame for the
    /// batch. Otherwise (a delivery below it is still being worked on, or its settlement
    /// is on its way) each has its own `basic.ack`, so no delivery outside the batch is
    /// acknowledged: these are handed to the connection all at once, then awaited
    /// together. Each one taken is counted, whichever failed; the first failure is
    /// returned. Those still pending when the channel closes are not counted: the broker
    /// delivers them again.
    async fn ack_all(&self, deliveries: &[&Self::Delivery], acked: &mut u64) -> Result<(), Error> {
        let (_, channel, unsettled) = self.open();
        if let Some(last) = unsettled.one_ack_for(deliveries) {
            let all_up_to_last = BasicAckOptions { multiple: true };
            taken(while_open(&channel, last.ack(all_up_to_last)).await?)?;
            unsettled.settled(deliveries);
            *acked += deliveries.len() as u64;
            return Ok(());
        }
        let mut acks: futures_util::stream::FuturesOrdered<_> = deliveries
            .iter()
            .map(|&delivery| {
                delivery
                    .ack(BasicAckOptions::default())
                    .map(move |done| (delivery, done))
            })
            .collect();
        let mut failed = None;
        let all = async {
            while let Some((delivery, done)) = acks.next().await {
                match done.map_err(broker).and_then(taken) {
                    Ok(()) => {
                        delivery.unsettled.settled(&[delivery]);
                        *acked += 1;
                    }
                    Err(error) if failed.is_none() => failed = Some(error),
                    Err(_) => {}
                }
            }
            Ok::<(), lapin::Error>(())
        };
        while_open(&channel, all).await?;
        failed.map_or(Ok(()), Err)
    }
}

impl Amqp {
    /// The connection and channel in use, with the channel's deliveries not settled.
    fn open(&self) -> Open {
        let open = crate::lock(&self.open);
        (Arc::clone(&open.0), open.1.clone(), Arc::clone(&open.2))
    }

    /// Publishes the delivery again, with its properties, to `queue` through the default
    /// exchange, and waits for the broker's confirm.
    async fn publish_copy(
        &self,
        channel: &Channel,
        delivery: &AmqpDelivery,
        queue: &str,
        attempt: u32,
        reason: Option<&str>,
    ) -> Result<(), Error> {
        let original = delivery.properties.headers().clone().unwrap_or_default();
        // The copy is a new message to the broker: its count of this one's returns is
        // carried in the attempt instead.
        let mut headers = FieldTable::from(
            original
                .inner()
                .iter()
                .filter(|(name, _)| name.as_str() != DELIVERY_COUNT_HEADER)
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect::<std::collections::BTreeMap<_, _>>(),
        );
        headers.insert(
            ATTEMPT_HEADER.into(),
            AMQPValue::LongLongInt(attempt.into()),
        );
        if let Some(reason) = reason {
            let reason = truncate(reason, REASON_BYTES);
            headers.insert(REASON_HEADER.into(), AMQPValue::LongString(reason.into()));
        }
        let properties = delivery.properties.clone().with_headers(headers);
        publish(channel, "", queue, &delivery.data, properties).await
    }
}

#[cfg(test)]
mod tests {
    use super::one_ack_tag;
    use std::collections::BTreeSet;

    #[test]
    fn one_multiple_ack_only_for_every_unsettled_tag_up_to_the_highest() {
        let unsettled: BTreeSet<u64> = [3, 4, 5, 6, 7].into();
        assert_eq!(
            one_ack_tag(&unsettled, &[3, 4, 5]),
            Some(5),
            "a whole prefix"
        );
        assert_eq!(one_ack_tag(&unsettled, &[5, 3, 4]), Some(5), "in any order");
        assert_eq!(
            one_ack_tag(&unsettled, &[4, 5]),
            None,
            "3 below is unsettled"
        );
        assert_eq!(one_ack_tag(&unsettled, &[6, 7]), None, "a gap below");
        assert_eq!(
            one_ack_tag(&unsettled, &[2, 3]),
            None,
            "2 is settled already"
        );
        assert_eq!(one_ack_tag(&unsettled, &[3]), None, "one has its own ack");
        assert_eq!(one_ack_tag(&unsettled, &[]), None);
        assert_eq!(
            one_ack_tag(&BTreeSet::new(), &[1, 2]),
            None,
            "another channel's"
        );
    }
}
