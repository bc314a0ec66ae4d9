//! A one-statement effect run with a claim: the user's SQL and its typed binds, reading a
//! one-row relation named `claimed` that exists only when the key was claimed now.

use crate::backend::Backend;
use crate::tables::Tables;
use justonce_core::Error;
use sqlx::{Arguments, AssertSqlSafe, Encode, Executor, IntoArguments, Type};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The relation an [`Effect`] reads, to do nothing unless the key was claimed now.
const CLAIMED: &str = "claimed";

/// One SQL statement, with its binds, that [`crate::Inbox::run_effect`] runs once per key.
///
/// It must read a relation named `claimed`, after `FROM`, `JOIN` or `USING` or in a list of
/// tables, which holds one row when the key was claimed by this run and none otherwise, so
/// that it does nothing for a duplicate:
/// `INSERT INTO ledger (account, amount) SELECT $1, $2 FROM claimed` or
/// `UPDATE balances SET amount = amount + $2 FROM claimed WHERE account = $1`. Its one
/// column is `justonce_claimed`, and an alias (`FROM claimed c`) works. Its
/// parameters are numbered or placed as the database writes them (`$1` on PostgreSQL,
/// `?` on SQLite and MariaDB). It has no `RETURNING` clause of its own.
pub struct Effect<DB: sqlx::Database> {
    pub(crate) sql: String,
    pub(crate) arguments: DB::Arguments,
    /// The first bind that could not be encoded: reported before anything is sent.
    unbound: Option<String>,
}

impl<DB: sqlx::Database> Effect<DB> {
    /// The statement's SQL, without binds yet.
    pub fn new(sql: impl Into<String>) -> Self {
        Self {
            sql: sql.into(),
            arguments: DB::Arguments::default(),
            unbound: None,
        }
    }

    /// Binds the next parameter.
    pub fn bind<'t, T: Encode<'t, DB> + Type<DB>>(mut self, value: T) -> Self {
        if let Err(error) = self.arguments.add(value)
            && self.unbound.is_none()
        {
            let place = self.arguments.len() + 1;
            self.unbound = Some(format!("bind {place} could not be encoded: {error}"));
        }
        self
    }

    /// The SQL with its trailing semicolons and blanks removed, after checking that it is
    /// one statement that reads `claimed`; and where `claimed` is read as a relation, as
    /// byte ranges.
    fn checked(&self) -> Result<(&str, Vec<std::ops::Range<usize>>), Error> {
        let sql = self
            .sql
            .trim_end_matches(|c: char| c == ';' || c.is_whitespace());
        let places = relation_places(sql)?;
        if places.is_empty() {
            // Without it the statement would run whether the key is new or not.
            return Err(Error::InvalidStatement(format!(
                "it does not read the relation `{CLAIMED}` after FROM, JOIN or USING, so it \
                 would take effect for duplicates too"
            )));
        }
        Ok((sql, places))
    }

    /// The SQL with its trailing semicolons and blanks removed.
    pub(crate) fn trimmed(&self, checked: &CheckedEffect) -> &str {
        &self.sql[..checked.len]
    }
}

/// What checking an effect's SQL found, and the one statement that claims a key and runs
/// it: the same for every run of the same SQL with as many binds.
pub(crate) struct CheckedEffect {
    /// The length of the SQL without its trailing semicolons and blanks.
    len: usize,
    /// Where `claimed` is read as a relation, as byte ranges.
    pub(crate) places: Vec<std::ops::Range<usize>>,
    binds: usize,
    /// The claim and the effect in one statement, where the database has one.
    pub(crate) one_statement: Option<Arc<str>>,
}

/// The effects an inbox has run, checked, by their SQL: a consumer runs the same few
/// statements for every message, so each is checked and its one statement written once.
#[derive(Default)]
pub(crate) struct CheckedEffects(Mutex<HashMap<String, Arc<CheckedEffect>>>);

impl CheckedEffects {
    /// More SQL texts than this (made per message, say) start the memory afresh.
    const MOST: usize = 256;

    /// `effect` checked, as [`Effect`] describes, for this database and `tables`: an error
    /// when a bind could not be encoded or the SQL is not one statement reading `claimed`.
    pub(crate) fn check<DB: Backend>(
        &self,
        effect: &Effect<DB>,
        tables: &Tables,
    ) -> Result<Arc<CheckedEffect>, Error> {
        if let Some(unbound) = &effect.unbound {
            return Err(Error::InvalidStatement(unbound.clone()));
        }
        let binds = effect.arguments.len();
        let mut known = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(checked) = known.get(&effect.sql)
            && checked.binds == binds
        {
            return Ok(Arc::clone(checked));
        }
        let (sql, places) = effect.checked()?;
        let checked = Arc::new(CheckedEffect {
            len: sql.len(),
            one_statement: DB::claim_with_effect_sql(tables, sql, binds).map(Arc::from),
            places,
            binds,
        });
        if known.len() >= Self::MOST {
            known.clear();
        }
        known.insert(effect.sql.clone(), Arc::clone(&checked));
        Ok(checked)
    }
}

impl<DB: Backend> Clone for Effect<DB> {
    fn clone(&self) -> Self {
        Self {
            sql: self.sql.clone(),
            arguments: self.arguments.clone(),
            unbound: self.unbound.clone(),
        }
    }
}

impl<DB: sqlx::Database> std::fmt::Debug for Effect<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Effect")
            .field("sql", &self.sql)
            .field("binds", &self.arguments.len())
            .finish()
    }
}

/// The one column of `claimed`, on every path, holding 1.
pub(crate) const CLAIMED_COLUMN: &str = "justonce_claimed";

/// Words that may follow a relation in a FROM list and are not an alias of it.
const AFTER_RELATION: [&str; 24] = [
    "where",
    "set",
    "on",
    "using",
    "join",
    "inner",
    "left",
    "right",
    "full",
    "cross",
    "natural",
    "straight_join",
    "group",
    "order",
    "having",
    "limit",
    "offset",
    "fetch",
    "union",
    "except",
    "intersect",
    "window",
    "returning",
    "for",
];

/// Words that end a FROM list, or MariaDB's list of tables after `UPDATE`.
const AFTER_LIST: [&str; 16] = [
    "where",
    "set",
    "on",
    "group",
    "order",
    "having",
    "limit",
    "offset",
    "union",
    "except",
    "intersect",
    "select",
    "values",
    "returning",
    "window",
    "into",
];

/// `sql` with each place of `claimed` made a one-row derived table: what the statement
/// reads inside a transaction whose claim took the key. Every database takes this form, in
/// `INSERT … SELECT … FROM`, `UPDATE … FROM` and MariaDB's `UPDATE t, claimed`; MariaDB
/// takes no `WITH` before `INSERT` or `UPDATE`. An alias the statement gives `claimed`
/// (`claimed c`, `claimed AS c`) stays the derived table's.
pub(crate) fn with_claimed_row(sql: &str, places: &[std::ops::Range<usize>]) -> String {
    let mut out = String::with_capacity(sql.len() + 50 * places.len());
    let mut from = 0;
    for place in places {
        out.push_str(&sql[from..place.start]);
        out.push_str(&format!("(SELECT 1 AS {CLAIMED_COLUMN})"));
        let next = sql[place.end..].trim_start();
        let alias_len = next.bytes().take_while(|&b| is_word(b)).count();
        let aliased = alias_len > 0 && !one_of(&next[..alias_len], &AFTER_RELATION);
        if !aliased {
            out.push_str(" AS claimed");
        }
        from = place.end;
    }
    out.push_str(&sql[from..]);
    out
}

/// Whether `word` is one of `words`, whatever its case.
fn one_of(word: &str, words: &[&str]) -> bool {
    words.iter().any(|w| word.eq_ignore_ascii_case(w))
}

/// A byte of an unquoted SQL word.
fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80
}

/// Where `sql` names `claimed` as a relation: an unquoted word right after `FROM`, `JOIN`
/// or `USING`, or after a comma of a FROM list or of MariaDB's `UPDATE t, claimed`; outside
/// literals, quoted names and comments, and not qualifying a name. A column or an alias
/// named `claimed` is no place. A `;` that separates statements is an error: the database
/// would run the ones after it for duplicates too.
fn relation_places(sql: &str) -> Result<Vec<std::ops::Range<usize>>, Error> {
    let bytes = sql.as_bytes();
    let mut places = Vec::new();
    // Per depth of parentheses: whether a list of relations is open there.
    let mut lists = vec![false];
    // Whether a word here would name a relation.
    let mut relation_next = false;
    let mut i = 0;
    while i < bytes.len() {
        let rest = &sql[i..];
        let skip_to = |end: &str, from: usize| {
            rest[from..]
                .find(end)
                .map_or(sql.len(), |at| i + from + at + end.len())
        };
        match bytes[i] {
            quote @ (b'\'' | b'"' | b'`') => {
                // A doubled quote inside is part of the literal: the scan resumes on it.
                i = sql[i + 1..]
                    .find(quote as char)
                    .map_or(sql.len(), |at| i + 1 + at + 1);
                relation_next = false;
            }
            b'-' if rest.starts_with("--") => i = skip_to("\n", 2),
            b'/' if rest.starts_with("/*") => i = skip_to("*/", 2),
            b'$' if dollar_tag(rest).is_some() => {
                let tag = dollar_tag(rest).unwrap_or_default();
                i = skip_to(tag, tag.len());
                relation_next = false;
            }
            b';' => {
                return Err(Error::InvalidStatement(
                    "it holds more than one statement: `;` outside a literal".to_owned(),
                ));
            }
            b'(' => {
                lists.push(false);
                relation_next = false;
                i += 1;
            }
            b')' => {
                if lists.len() > 1 {
                    lists.pop();
                }
                relation_next = false;
                i += 1;
            }
            b',' => {
                relation_next = lists.last() == Some(&true);
                i += 1;
            }
            b if is_word(b) => {
                let end = rest
                    .bytes()
                    .position(|b| !is_word(b))
                    .map_or(sql.len(), |at| i + at);
                let word = &sql[i..end];
                let qualifying = sql[end..].trim_start().starts_with('.');
                if relation_next && word.eq_ignore_ascii_case(CLAIMED) && !qualifying {
                    places.push(i..end);
                }
                relation_next = one_of(word, &["from", "join", "using"]);
                if let Some(list) = lists.last_mut() {
                    if relation_next || word.eq_ignore_ascii_case("update") {
                        *list = true;
                    } else if one_of(word, &AFTER_LIST) {
                        *list = false;
                    }
                }
                i = end;
            }
            b if b.is_ascii_whitespace() => i += 1,
            _ => {
                relation_next = false;
                i += 1;
            }
        }
    }
    Ok(places)
}

/// The opening `$tag$` of a PostgreSQL dollar-quoted string at the start of `sql`.
fn dollar_tag(sql: &str) -> Option<&str> {
    let close = sql[1..].find('$')? + 2;
    let tag = &sql[..close];
    tag[1..close - 1]
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        .then_some(tag)
        .filter(|tag| !tag[1..2].bytes().all(|b| b.is_ascii_digit()))
}

/// Runs `sql` with `arguments` on `conn`; how many rows it changed.
pub(crate) async fn execute<DB>(
    conn: &mut DB::Connection,
    sql: String,
    arguments: DB::Arguments,
) -> Result<u64, sqlx::Error>
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
{
    let done = sqlx::query_with(AssertSqlSafe(sql), arguments)
        .execute(conn)
        .await?;
    Ok(DB::rows_affected(&done))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn places(sql: &str) -> Vec<&str> {
        relation_places(sql)
            .unwrap()
            .into_iter()
            .map(|r| &sql[r])
            .collect()
    }

    #[test]
    fn finds_claimed_only_as_a_relation() {
        assert_eq!(places("INSERT INTO t SELECT $1 FROM claimed"), ["claimed"]);
        assert_eq!(places("UPDATE t, Claimed SET a = ?"), ["Claimed"]);
        assert_eq!(places("UPDATE t AS x, u, claimed SET a = ?"), ["claimed"]);
        assert_eq!(
            places("SELECT 1 FROM t JOIN claimed AS c ON true"),
            ["claimed"]
        );
        assert_eq!(
            places("DELETE FROM t USING claimed WHERE k = $1"),
            ["claimed"]
        );
        assert_eq!(places("SELECT 1 FROM t, claimed c"), ["claimed"]);
        assert!(places("INSERT INTO t VALUES ('claimed')").is_empty());
        assert!(places("INSERT INTO \"claimed\" VALUES (1)").is_empty());
        assert!(places("INSERT INTO t VALUES (1) -- claimed").is_empty());
        assert!(places("INSERT INTO t VALUES (1) /* claimed */").is_empty());
        assert!(places("INSERT INTO t VALUES ($x$claimed$x$)").is_empty());
        assert!(places("INSERT INTO s.claimed VALUES (1)").is_empty());
        assert!(places("SELECT 1 FROM claimed.t").is_empty());
        assert!(places("INSERT INTO t SELECT claimed_at FROM u").is_empty());
        // A column, an alias, a column list: no relation.
        assert!(places("INSERT INTO orders (id, claimed) VALUES ($1, true)").is_empty());
        assert!(places("UPDATE t SET a = 1, claimed = true").is_empty());
        assert!(places("SELECT a, claimed FROM t").is_empty());
        assert!(places("SELECT 1 FROM t AS claimed").is_empty());
        assert!(places("SELECT 1 FROM t JOIN u USING (id, claimed)").is_empty());
        assert_eq!(
            places("INSERT INTO t SELECT $1 FROM claimed WHERE $2 = 'it''s'"),
            ["claimed"]
        );
    }

    #[test]
    fn refuses_more_than_one_statement() {
        let error = relation_places("INSERT INTO t SELECT 1 FROM claimed; DELETE FROM t");
        assert!(matches!(error, Err(Error::InvalidStatement(_))));
        assert!(relation_places("SELECT ';' FROM claimed -- ;").is_ok());
    }

    #[test]
    fn makes_claimed_a_row() {
        let rewrite = |sql: &str| with_claimed_row(sql, &relation_places(sql).unwrap());
        assert_eq!(
            rewrite("UPDATE t SET a = a + $2 FROM claimed WHERE k = $1"),
            "UPDATE t SET a = a + $2 FROM (SELECT 1 AS justonce_claimed) AS claimed WHERE k = $1"
        );
        assert_eq!(
            rewrite("UPDATE t SET a = 1 FROM claimed c WHERE c.justonce_claimed = 1"),
            "UPDATE t SET a = 1 FROM (SELECT 1 AS justonce_claimed) c WHERE c.justonce_claimed = 1"
        );
        assert_eq!(
            rewrite("SELECT 1 FROM t JOIN claimed AS c ON true"),
            "SELECT 1 FROM t JOIN (SELECT 1 AS justonce_claimed) AS c ON true"
        );
        assert_eq!(
            rewrite("UPDATE t, claimed SET a = 1"),
            "UPDATE t, (SELECT 1 AS justonce_claimed) AS claimed SET a = 1"
        );
    }
}
