//! The ways the bench processes the stream, and loads the receiver.

/// A way to process the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    HandWritten,
    OneStatement,
    Run,
    RunAgain,
    /// `Inbox::run_effect` with the effect row as its statement: on PostgreSQL one
    /// statement.
    RunEffect,
    /// The claim and a row forwarding the message, as `hand-written` sends them.
    HandWrittenForward,
    /// `Inbox::run_forward`: on PostgreSQL one statement.
    RunForward,
    /// `Inbox::run` with `Inbox::forward` as its work, as a broker consumer of the service
    /// runs it: four statements, and no NOTIFY in the transaction.
    RunWithForward,
    /// A batch insert of the keys and the effects' insert sent with plain sqlx, in batches
    /// of this many messages, a transaction each.
    HandWrittenBatched(usize),
    /// As `HandWrittenBatched`, with the statements `claim_many` sends to claim the keys and
    /// read the fingerprints of those already held.
    HandWrittenClaimMany(usize),
    /// In batches of this many messages, a transaction each.
    ClaimMany(usize),
}

impl Mode {
    /// The modes that start from empty tables and take a message at a time, baseline first.
    pub(crate) const ONE_BY_ONE: [Mode; 7] = [
        Mode::HandWritten,
        Mode::OneStatement,
        Mode::Run,
        Mode::RunEffect,
        Mode::HandWrittenForward,
        Mode::RunForward,
        Mode::RunWithForward,
    ];

    /// The names `--modes` takes: every mode but `run-again`, which comes with `run`.
    pub(crate) const NAMES: [&'static str; 10] = [
        "hand-written",
        "one-statement",
        "run",
        "run_effect",
        "hand-written-forward",
        "run_forward",
        "run-with-forward",
        "hand-written-batched",
        "hand-written-claim_many",
        "claim_many",
    ];

    /// The mode this one is compared with, in the same round.
    pub(crate) fn baseline(self) -> Option<Mode> {
        match self {
            Mode::OneStatement | Mode::Run | Mode::RunAgain | Mode::RunEffect => {
                Some(Mode::HandWritten)
            }
            Mode::RunForward | Mode::RunWithForward => Some(Mode::HandWrittenForward),
            Mode::HandWrittenClaimMany(batch) => Some(Mode::HandWrittenBatched(batch)),
            Mode::ClaimMany(batch) => Some(Mode::HandWrittenClaimMany(batch)),
            Mode::HandWritten | Mode::HandWrittenForward | Mode::HandWrittenBatched(_) => None,
        }
    }

    /// Whether the mode's effect is an outbox row rather than an effect row.
    pub(crate) fn forwards(self) -> bool {
        matches!(
            self,
            Mode::HandWrittenForward | Mode::RunForward | Mode::RunWithForward
        )
    }

    /// Messages per transaction, for the batched modes.
    pub(crate) fn batch(self) -> Option<usize> {
        match self {
            Mode::HandWrittenBatched(batch)
            | Mode::HandWrittenClaimMany(batch)
            | Mode::ClaimMany(batch) => Some(batch),
            _ => None,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::HandWritten => "hand-written",
            Mode::OneStatement => "one-statement",
            Mode::Run => "run",
            Mode::RunAgain => "run-again",
            Mode::RunEffect => "run_effect",
            Mode::HandWrittenForward => "hand-written-forward",
            Mode::RunForward => "run_forward",
            Mode::RunWithForward => "run-with-forward",
            Mode::HandWrittenBatched(_) => "hand-written-batched",
            Mode::HandWrittenClaimMany(_) => "hand-written-claim_many",
            Mode::ClaimMany(_) => "claim_many",
        }
    }
}

/// How the load generator sends.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Load {
    /// This many connections, each posting its next event when the last is answered.
    Clients(usize),
    /// Events started at this many per second.
    Rate(usize),
}

impl Load {
    /// The events' id prefix: each load's events are new to the receiver.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Load::Clients(_) => "clients",
            Load::Rate(_) => "rate",
        }
    }

    pub(crate) fn described(self) -> String {
        match self {
            Load::Clients(clients) => format!("from {clients} clients"),
            Load::Rate(rate) => format!("started at {rate}/s"),
        }
    }

    pub(crate) fn json_field(self) -> (&'static str, usize) {
        match self {
            Load::Clients(clients) => ("clients", clients),
            Load::Rate(rate) => ("rate", rate),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Mode;

    #[test]
    fn every_mode_but_run_again_can_be_named() {
        let batched = [
            Mode::HandWrittenBatched(1),
            Mode::HandWrittenClaimMany(1),
            Mode::ClaimMany(1),
        ];
        let names: Vec<&str> = Mode::ONE_BY_ONE
            .into_iter()
            .chain(batched)
            .map(Mode::name)
            .collect();
        assert_eq!(names, Mode::NAMES);
    }
}
