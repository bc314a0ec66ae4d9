use crate::Error;
use std::time::Duration;

/// How long processed keys are kept, and how long the sender retries.
///
/// A key purged while the sender may still retry lets a retry through as new work, so a
/// retention shorter than the retry horizon is refused.
///
/// ```
/// # use std::time::Duration;
/// # use justonce_core::{Error, Retention};
/// const DAY: Duration = Duration::from_secs(86_400);
/// assert!(Retention::new(7 * DAY, 3 * DAY).is_ok());
/// let err = Retention::new(DAY, 3 * DAY).unwrap_err();
/// assert!(matches!(err, Error::RetentionBelowHorizon { .. }));
/// assert!(err.to_string().contains("1d") && err.to_string().contains("3d"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    keep: Duration,
    retry_horizon: Duration,
}

impl Retention {
    /// Keys are kept 7 days by default.
    pub const DEFAULT_KEEP: Duration = Duration::from_secs(7 * 86_400);
    /// Senders are assumed to retry for 3 days unless declared otherwise.
    pub const DEFAULT_RETRY_HORIZON: Duration = Duration::from_secs(3 * 86_400);

    /// Keep keys for `keep`, for a sender that retries for `retry_horizon`.
    pub fn new(keep: Duration, retry_horizon: Duration) -> Result<Self, Error> {
        if keep < retry_horizon {
            return Err(Error::RetentionBelowHorizon {
                retention: keep,
                retry_horizon,
            });
        }
        Ok(Self {
            keep,
            retry_horizon,
        })
    }

    /// How long keys are kept.
    pub fn keep(&self) -> Duration {
        self.keep
    }

    /// How long the sender retries: the floor for [`Retention::keep`].
    pub fn retry_horizon(&self) -> Duration {
        self.retry_horizon
    }
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            keep: Self::DEFAULT_KEEP,
            retry_horizon: Self::DEFAULT_RETRY_HORIZON,
        }
    }
}
