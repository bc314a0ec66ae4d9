use std::fmt;

/// A position in a stream, kept in the same transaction as the work.
///
/// Most brokers number their messages with one integer: `Offset::from(42)`. Redis entry ids
/// (`1700000000000-3`) are two: `Offset::new(1700000000000, 3)`. Offsets compare as the
/// pair (position, sequence).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Offset {
    /// The main position: a sequence number, or a Redis entry id's milliseconds.
    pub position: i64,
    /// The tie-breaker within a position: a Redis entry id's sequence; otherwise 0.
    pub sequence: i64,
}

impl Offset {
    /// The offset (position, sequence).
    pub fn new(position: i64, sequence: i64) -> Self {
        Self { position, sequence }
    }
}

impl From<i64> for Offset {
    fn from(position: i64) -> Self {
        Self::new(position, 0)
    }
}

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.sequence {
            0 => write!(f, "{}", self.position),
            sequence => write!(f, "{}-{sequence}", self.position),
        }
    }
}

/// What storing an offset found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "an offset that did not move means the entry was already processed: roll back"]
pub enum OffsetCommit {
    /// The stored offset moved forward to this one: commit.
    Moved,
    /// The stored offset is already at or past this one: this entry was processed before.
    /// Roll the transaction back.
    AlreadyProcessed,
}
