//! A benchmark's consumer, written once over every broker: with the tests' work, or only
//! acknowledging, which is the broker's own limit.

use crate::{TestBackend, batch_work, consumer_work};
use justonce_transport::{Broker, Consumer, ConsumerStats, Error, Receive};
use std::sync::atomic::{AtomicU64, Ordering};

/// Takes `count` deliveries from `consumer`, each time the ones that have arrived up to
/// `batch`, and runs the tests' work for them with [`Consumer::settle_batch`] (in the tables
/// under `prefix`). After each batch, stores in `settled` how many are settled. Returns
/// what the consumer counted.
pub async fn consume<B: Broker, DB: TestBackend>(
    consumer: &Consumer<B, DB>,
    prefix: &str,
    taking: (usize, usize),
    settled: &AtomicU64,
) -> ConsumerStats {
    let work = consumer_work::<DB>(prefix);
    let settle = async |batch: &[B::Delivery], stats: &mut ConsumerStats| {
        consumer.settle_batch(batch, &work, stats).await
    };
    take_batches(consumer, taking, settled, settle).await
}

/// As [`consume`], with the tests' batch work run once per batch, its effects written with
/// one statement ([`Consumer::settle_batch_at_once`]).
pub async fn consume_batches<B: Broker, DB: TestBackend>(
    consumer: &Consumer<B, DB>,
    prefix: &str,
    taking: (usize, usize),
    settled: &AtomicU64,
) -> ConsumerStats {
    let work = batch_work::<DB>(prefix, None);
    let settle = async |batch: &[B::Delivery], stats: &mut ConsumerStats| {
        consumer.settle_batch_at_once(batch, &work, stats).await
    };
    take_batches(consumer, taking, settled, settle).await
}

/// Takes `count` deliveries from `consumer` in batches of up to `batch` and settles each
/// batch with `settle`, storing in `settled` how many are settled after each.
async fn take_batches<B: Broker, DB: TestBackend>(
    consumer: &Consumer<B, DB>,
    (count, batch): (usize, usize),
    settled: &AtomicU64,
    mut settle: impl AsyncFnMut(&[B::Delivery], &mut ConsumerStats) -> Result<bool, Error>,
) -> ConsumerStats {
    let mut stats = ConsumerStats::default();
    let mut deliveries = consumer.deliveries().await.expect("consuming");
    while ((stats.processed + stats.duplicates) as usize) < count {
        let first = deliveries.next().await.expect("a delivery");
        let first = first.expect("not cancelled");
        let batch = deliveries.more(first, batch).await.expect("a batch");
        settle(&batch, &mut stats).await.expect("settled");
        settled.store(stats.processed + stats.duplicates, Ordering::Relaxed);
    }
    deliveries.stop().await.expect("stopped");
    stats
}

/// Takes `count` deliveries from `broker` as [`consume`] does, in the same batches, and only
/// acknowledges them (all of a batch at once, as [`Consumer::settle_batch`] does), with no
/// database work: what the broker and its client take at most with this prefetch and batch
/// size. Stores the count acknowledged in `settled` after each batch.
pub async fn acknowledge<B: Broker>(
    broker: &B,
    (count, batch): (usize, usize),
    settled: &AtomicU64,
) {
    let mut receiver = broker.receive().await.expect("receiving");
    let mut acked = 0;
    while (acked as usize) < count {
        let first = receiver.next().await.expect("a delivery");
        let first = first.expect("not cancelled");
        let batch = receiver.more(first, batch).await.expect("a batch");
        let batch: Vec<&B::Delivery> = batch.iter().collect();
        broker
            .ack_all(&batch, &mut acked)
            .await
            .expect("acknowledged");
        settled.store(acked, Ordering::Relaxed);
    }
    receiver.stop().await.expect("stopped");
}
