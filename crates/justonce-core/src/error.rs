use std::time::Duration;

/// A boxed error kept as the `source` of an [`Error`], such as the database driver's own.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in justonce. Match on the variants; new ones may be added.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key was rejected before anything touched a database.
    #[error("invalid key: {0}")]
    InvalidKey(Invalid),
    /// The consumer name was rejected before anything touched a database.
    #[error("invalid consumer name: {0}")]
    InvalidConsumer(Invalid),
    /// The scope was rejected before anything touched a database.
    #[error("invalid scope: {0}")]
    InvalidScope(Invalid),
    /// Keys would be purged while the sender may still retry.
    #[error(
        "retention of {} is shorter than the sender's retry horizon of {}: \
         a retried message would be processed again",
        humanize(*retention),
        humanize(*retry_horizon)
    )]
    RetentionBelowHorizon {
        /// How long keys would be kept.
        retention: Duration,
        /// How long the sender retries.
        retry_horizon: Duration,
    },
    /// A statement given to run with a claim was rejected before anything touched a
    /// database: it does not read `claimed`, or a value bound to it could not be encoded.
    #[error("invalid statement: {0}")]
    InvalidStatement(String),
    /// A setting is unusable, such as a table prefix that is not an identifier.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The database tables are missing, altered, or newer than this version of justonce.
    #[error("database schema: {0}")]
    Schema(String),
    /// The database failed; `retryable` is true for serialization failures, deadlocks and
    /// lock timeouts that a new transaction may not hit.
    #[error("database error: {source}")]
    Database {
        /// Whether running the transaction again may succeed.
        retryable: bool,
        /// The driver's error.
        #[source]
        source: BoxError,
    },
    /// The connection broke after COMMIT was sent, and reading the key back could not tell
    /// whether the commit happened. Do not acknowledge the message: its redelivery claims
    /// the key again and finds out.
    #[error("the commit's answer was lost and could not be resolved: {source}")]
    CommitUnknown {
        /// Why the key could not be read back.
        #[source]
        source: BoxError,
    },
    /// A replay of events of this source or consumer was refused: an earlier replay of an
    /// overlapping time range still has events waiting for their delivery. Replaying it
    /// again would deliver them twice more.
    #[error(
        "replay {window} of {origin} overlaps this time range and is still running: \
         its events are not all delivered yet"
    )]
    ReplayRunning {
        /// The source's or consumer's name.
        origin: String,
        /// The id of the replay still running.
        window: i64,
    },
    /// A listing's cursor is not one a listing handed out.
    #[error("invalid cursor: {0}")]
    InvalidCursor(String),
    /// The lease ran out and another holder took the key over (or it was completed or
    /// released already): this holder's result is not stored.
    #[error("lease on key {key} is no longer held by token {token}")]
    LeaseLost {
        /// The key.
        key: String,
        /// The stale token.
        token: i64,
    },
}

impl Error {
    /// A database failure, with the driver's error kept as its `source`. `retryable` says
    /// whether running the transaction again may succeed (see [`Error::is_retryable`]).
    pub fn database(retryable: bool, source: impl Into<BoxError>) -> Self {
        Error::Database {
            retryable,
            source: source.into(),
        }
    }

    /// Whether the same work may succeed when run again in a new transaction.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::Database {
                retryable: true,
                ..
            }
        )
    }
}

/// Why a key, consumer name or scope was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Invalid {
    /// The value is empty.
    #[error("it is empty")]
    Empty,
    /// The value is longer than allowed, counted in UTF-8 bytes.
    #[error("it is {len} bytes long, more than the {max} allowed")]
    TooLong {
        /// The value's length in bytes.
        len: usize,
        /// The largest length allowed.
        max: usize,
    },
    /// The value contains NUL or another control character.
    #[error("it contains the control character {character:?} at byte {position}")]
    ControlCharacter {
        /// The offending character.
        character: char,
        /// Its byte offset in the value.
        position: usize,
    },
    /// A part of a purpose key is empty or contains the `:` separator.
    #[error("part {index} ({part:?}) of the purpose key is empty or contains ':'")]
    BadPart {
        /// The zero-based index of the part.
        index: usize,
        /// The part as given.
        part: String,
    },
}

/// Formats a duration the way people write retention settings: `7d`, `36h`, `90s`.
fn humanize(duration: Duration) -> String {
    let secs = duration.as_secs();
    let units = [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")];
    match units
        .iter()
        .find(|(size, _)| secs >= *size && secs.is_multiple_of(*size))
    {
        Some((size, unit)) => format!("{}{unit}", secs / size),
        None => format!("{duration:?}"),
    }
}
