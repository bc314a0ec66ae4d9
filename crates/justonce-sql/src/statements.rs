//! The texts of the statements `Inbox::claim_many` sends, for a benchmark that sends the
//! same statements by hand beside it (`justonce bench`), so that there is one copy of them.
//!
//! Not a stable API: the statements change with the library, and this module with them.
//!
//! Their parameters, in order:
//!
//! | backend | `insert_many` | `find_many` |
//! |---|---|---|
//! | PostgreSQL | scope, consumer, keys (`text[]`), fingerprints (`bytea[]`), claim id | scope, consumer, keys (`text[]`) |
//! | SQLite | scope, consumer, claim id, JSON array of `[key, hex fingerprint]` | scope, consumer, JSON array of keys |
//! | MariaDB/MySQL | per key: scope, consumer, key, fingerprint, claim id | each key, then scope, consumer |
//!
//! On PostgreSQL `insert_many` also returns the keys it did not insert that were held
//! before it began, with their claim id and fingerprint.

// Each constructor names its backend's items itself: the crate builds with any set of
// backend features, none included.
/// The statements that claim a batch of keys under one table prefix.
#[derive(Debug, Clone)]
pub struct ClaimMany {
    insert_many: String,
    find_many: String,
    /// MariaDB/MySQL: one key's row of `insert_many`'s list.
    row: String,
    /// `find_many` for a number of keys.
    find_many_of: fn(&str, usize) -> String,
}

impl ClaimMany {
    /// The statement that inserts `keys` keys, skipping those already held.
    pub fn insert_many(&self, keys: usize) -> String {
        with_list(&self.insert_many, &self.row, keys)
    }

    /// The statement that reads the claim id and fingerprint of `keys` keys held.
    pub fn find_many(&self, keys: usize) -> String {
        (self.find_many_of)(&self.find_many, keys)
    }
}

/// `template` with its list of `count` items, where it has one (MariaDB/MySQL).
fn with_list(template: &str, item: &str, count: usize) -> String {
    if template.contains("{list}") {
        template.replace("{list}", &vec![item; count].join(", "))
    } else {
        template.to_owned()
    }
}

/// PostgreSQL's statements for tables under `prefix`.
#[cfg(feature = "postgres")]
pub fn postgres(prefix: &str) -> Result<ClaimMany, justonce_core::Error> {
    let statements = <sqlx::Postgres as crate::backend::Backend>::statements(
        &crate::tables::Tables::new(prefix)?,
    );
    Ok(ClaimMany {
        insert_many: statements.insert_many.to_string(),
        find_many: statements.find_many.to_string(),
        row: String::new(),
        find_many_of: |find_many, _| find_many.to_owned(),
    })
}

/// SQLite's statements for tables under `prefix`.
#[cfg(feature = "sqlite")]
pub fn sqlite(prefix: &str) -> Result<ClaimMany, justonce_core::Error> {
    let statements =
        <sqlx::Sqlite as crate::backend::Backend>::statements(&crate::tables::Tables::new(prefix)?);
    Ok(ClaimMany {
        insert_many: statements.insert_many.to_string(),
        find_many: statements.find_many.to_string(),
        row: String::new(),
        find_many_of: |find_many, _| find_many.to_owned(),
    })
}

/// MariaDB's and MySQL's statements for tables under `prefix`.
#[cfg(feature = "mysql")]
pub fn mysql(prefix: &str) -> Result<ClaimMany, justonce_core::Error> {
    let statements =
        <sqlx::MySql as crate::backend::Backend>::statements(&crate::tables::Tables::new(prefix)?);
    Ok(ClaimMany {
        insert_many: statements.insert_many.to_string(),
        find_many: statements.find_many.to_string(),
        row: crate::mysql::insert_many_row(),
        find_many_of: crate::mysql::with_keys,
    })
}

/// The most keys `claim_many` puts in one statement on MariaDB and MySQL.
#[cfg(feature = "mysql")]
pub const MYSQL_KEYS_PER_STATEMENT: usize = crate::mysql::KEYS_PER_STATEMENT;

/// The most parameters MariaDB and MySQL bind to one statement.
#[cfg(feature = "mysql")]
pub const MYSQL_MAX_PARAMETERS: usize = crate::mysql::MAX_PARAMETERS;
