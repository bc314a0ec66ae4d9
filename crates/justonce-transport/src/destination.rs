//! What the relay's broker destinations share: a connection opened on the first delivery
//! and again after a failed publish, and the [`Destination`](justonce_core::Destination)
//! over each broker's own publish code.

use crate::Error;
use justonce_core::Delivery;
use std::future::Future;

/// A broker destination's own code: how it connects and how it publishes one row. Its
/// `send` publishes through the [`Reopening`] connection it keeps.
pub(crate) trait Publish: Sync {
    /// What a row is published through.
    type Connection: Send;

    /// Opens a connection.
    fn open(&self) -> impl Future<Output = Result<Self::Connection, Error>> + Send;

    /// Publishes `delivery` through `connection` and waits for the broker to take it.
    fn publish(
        &self,
        connection: &Self::Connection,
        delivery: Delivery<'_>,
    ) -> impl Future<Output = Result<(), String>> + Send;

    /// The connection kept between deliveries.
    fn connection(&self) -> &Reopening<Self::Connection>;

    /// Publishes `delivery` through the kept connection, opened first if none is.
    fn send(&self, delivery: Delivery<'_>) -> impl Future<Output = Result<(), String>> + Send {
        self.connection().publish(self, delivery)
    }
}

/// A destination's connection: opened on the first delivery, and dropped after a failed
/// publish so that the next delivery opens a new one. One publish at a time.
#[derive(Debug)]
pub(crate) struct Reopening<C>(tokio::sync::Mutex<Option<C>>);

impl<C> Default for Reopening<C> {
    fn default() -> Self {
        Self(tokio::sync::Mutex::new(None))
    }
}

impl<C: Send> Reopening<C> {
    async fn publish<P: Publish<Connection = C> + ?Sized>(
        &self,
        destination: &P,
        delivery: Delivery<'_>,
    ) -> Result<(), String> {
        let mut open = self.0.lock().await;
        let connection = match open.take() {
            Some(connection) => connection,
            None => (destination.open().await).map_err(|e| format!("connecting: {e}"))?,
        };
        let sent = destination.publish(&connection, delivery).await;
        match &sent {
            Ok(()) => *open = Some(connection),
            Err(error) => tracing::debug!(%error, "publishing failed: connecting again next time"),
        }
        sent
    }
}

/// A publisher's answer to the relay: sent, or to be tried again for `reason`.
pub(crate) fn delivered(sent: Result<(), String>) -> justonce_core::Delivered {
    match sent {
        Ok(()) => justonce_core::Delivered::Sent,
        Err(reason) => justonce_core::Delivered::Retry {
            after: None,
            reason,
        },
    }
}

/// The relay's [`Destination`](justonce_core::Destination) for a broker destination with a
/// `send`, its own or [`Publish::send`].
macro_rules! destination {
    ($destination:ty) => {
        impl justonce_core::Destination for $destination {
            fn deliver<'a>(
                &'a self,
                delivery: justonce_core::Delivery<'a>,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = justonce_core::Delivered> + Send + 'a>,
            > {
                Box::pin(async move { $crate::destination::delivered(self.send(delivery).await) })
            }
        }
    };
}
pub(crate) use destination;
