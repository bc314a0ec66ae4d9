//! Which database a URL names: the one rule every command, the settings and the bench use.

use crate::Usage;
use std::fmt;

/// The kinds of database justonce stores keys in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatabaseKind {
    /// A `sqlite:` file or memory.
    Sqlite,
    /// A `postgres:` or `postgresql:` server.
    Postgres,
    /// A `mysql:` or `mariadb:` server.
    MySql,
}

impl DatabaseKind {
    /// The kind of database `url` names, by its scheme.
    pub fn of(url: &str) -> Result<Self, UnknownDatabase> {
        const SCHEMES: [(&str, DatabaseKind); 5] = [
            ("sqlite:", DatabaseKind::Sqlite),
            ("postgres:", DatabaseKind::Postgres),
            ("postgresql:", DatabaseKind::Postgres),
            ("mysql:", DatabaseKind::MySql),
            ("mariadb:", DatabaseKind::MySql),
        ];
        SCHEMES
            .iter()
            .find(|(scheme, _)| url.starts_with(scheme))
            .map(|&(_, kind)| kind)
            .ok_or(UnknownDatabase)
    }

    /// The kind of database `url` names; for a URL of no kind it knows, bad usage that
    /// names `origin`, the option or setting the URL came from.
    pub fn named_by(url: &str, origin: impl fmt::Display) -> Result<Self, Usage> {
        Self::of(url).map_err(|unknown| Usage(format!("{origin}: {unknown}")))
    }
}

/// A URL whose scheme names no database justonce knows. It does not hold the URL, which may
/// hold a password.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownDatabase;

impl fmt::Display for UnknownDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("must be a sqlite://, postgres:// or mysql:// URL")
    }
}

impl std::error::Error for UnknownDatabase {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_scheme_names_its_kind_and_any_other_is_unknown() {
        for (url, kind) in [
            ("sqlite://justonce.db", DatabaseKind::Sqlite),
            ("sqlite::memory:", DatabaseKind::Sqlite),
            ("postgres://db/app", DatabaseKind::Postgres),
            ("postgresql://db/app", DatabaseKind::Postgres),
            ("mysql://db/app", DatabaseKind::MySql),
            ("mariadb://db/app", DatabaseKind::MySql),
        ] {
            assert_eq!(DatabaseKind::of(url), Ok(kind), "{url}");
        }
        for url in [
            "redis://db",
            "justonce.db",
            "",
            "POSTGRES://db",
            "sqlserver://db",
        ] {
            assert_eq!(DatabaseKind::of(url), Err(UnknownDatabase), "{url}");
        }
        assert_eq!(
            UnknownDatabase.to_string(),
            "must be a sqlite://, postgres:// or mysql:// URL"
        );
        assert_eq!(
            DatabaseKind::named_by("redis://db", "--database")
                .unwrap_err()
                .to_string(),
            "--database: must be a sqlite://, postgres:// or mysql:// URL"
        );
    }
}
