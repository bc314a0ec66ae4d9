use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// One outbox row on its way out: what a [`Destination`] sends.
#[derive(Debug, Clone, Copy)]
pub struct Delivery<'a> {
    /// The outbox row's id.
    pub id: i64,
    /// The downstream idempotency key: send it as the receiver's idempotency key or message
    /// id, the same on every attempt.
    pub key: &'a str,
    /// The destination's name, as the row was written.
    pub destination: &'a str,
    /// The bytes to send.
    pub payload: &'a [u8],
    /// Headers written with the row.
    pub headers: &'a [(String, String)],
    /// This is the row's `attempt`th delivery, counting from 1.
    pub attempt: u32,
}

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivered {
    /// The receiver has it: mark the row sent.
    Sent,
    /// A failure that may pass: try again later, after `after` if the receiver said so
    /// (`Retry-After`), or after the relay's backoff.
    Retry {
        /// How long the receiver asked to wait.
        after: Option<Duration>,
        /// Why, kept as the row's last error.
        reason: String,
    },
    /// A failure that will not pass (a 4xx other than 408, 425 and 429): dead-letter the row
    /// at once.
    Reject {
        /// Why, kept as the row's last error.
        reason: String,
    },
}

/// What the receiver answered to one delivery, for the row's history: an HTTP status and
/// the start of the body. A broker's publish has neither.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Answer {
    /// The status code, where the receiver speaks HTTP.
    pub status: Option<u16>,
    /// The start of the answer's body as the receiver sent it; the relay keeps at most
    /// 512 bytes of it, as text.
    pub body_start: Option<String>,
}

impl Answer {
    /// An HTTP answer: its status and the start of its body.
    pub fn http(status: u16, body_start: impl Into<String>) -> Self {
        Self {
            status: Some(status),
            body_start: Some(body_start.into()),
        }
    }
}

/// Where outbox rows go: an HTTP endpoint, a broker, anything that can take a message with
/// a key. Registered with the relay under the name rows are written with.
pub trait Destination: Send + Sync {
    /// Sends one delivery. Never panics on a bad answer: it says [`Delivered::Retry`] or
    /// [`Delivered::Reject`].
    fn deliver<'a>(
        &'a self,
        delivery: Delivery<'a>,
    ) -> Pin<Box<dyn Future<Output = Delivered> + Send + 'a>>;

    /// [`deliver`](Self::deliver), with what the receiver answered, which the relay keeps
    /// in the row's history. A destination whose receiver answers with more than "taken"
    /// or an error (an HTTP status, a body) says it here; the others keep this default,
    /// which records no answer.
    fn deliver_answered<'a>(
        &'a self,
        delivery: Delivery<'a>,
    ) -> Pin<Box<dyn Future<Output = (Delivered, Answer)> + Send + 'a>> {
        let delivered = self.deliver(delivery);
        Box::pin(async move { (delivered.await, Answer::default()) })
    }
}
