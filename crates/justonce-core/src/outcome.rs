use crate::Fingerprint;

/// What claiming a key inside a transaction found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a duplicate must skip the work"]
pub enum Claim {
    /// This transaction holds the key: do the work, then commit.
    First,
    /// The key was already processed with the same payload: skip the work.
    Duplicate,
    /// The key was already processed with another payload: the sender reused a key.
    /// Skip the work and report it.
    KeyReused {
        /// The fingerprint stored with the key.
        stored: Fingerprint,
        /// The fingerprint of the payload just received.
        received: Fingerprint,
    },
}

/// What running one unit of work did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Outcome<T> {
    /// The claim, the work and its writes committed together; `T` is what the work returned.
    Processed(T),
    /// The key was already processed: nothing ran and nothing was written.
    Duplicate,
    /// The key was already processed with another payload: nothing ran.
    KeyReused {
        /// The fingerprint stored with the key.
        stored: Fingerprint,
        /// The fingerprint of the payload just received.
        received: Fingerprint,
    },
}

impl<T> Outcome<T> {
    /// The work's result, if it ran.
    pub fn processed(self) -> Option<T> {
        match self {
            Outcome::Processed(value) => Some(value),
            _ => None,
        }
    }
}
