//! Values written into SQL text, for the simple queries that carry several
//! statements in one round trip (the protocol's extended queries, which
//! take parameters, carry one). Text is dollar-quoted, so that no setting
//! (`standard_conforming_strings`) changes how it reads, and every value is
//! cast to the type sqlx declares when it binds it: the statement means
//! the same as with parameters. The statements are prepared on each
//! connection (`PREPARE`), so that PostgreSQL plans them once, as it does
//! those sqlx prepares: planned on every call, a simple query's statement
//! cost more than the round trip it saved (churn 4 to 13% slower).

use crate::store::db::Arg;

/// A dollar-quote tag (`$hf$`, `$hf1$`, ...) that none of `values` contains.
pub fn dollar_tag(values: &[&str]) -> String {
    (0..)
        .map(|n: u64| match n {
            0 => "$hf$".to_owned(),
            n => format!("$hf{n}$"),
        })
        .find(|tag| values.iter().all(|v| !v.contains(tag.as_str())))
        .unwrap_or_default()
}

fn literal(arg: &Arg<'_>) -> Option<String> {
    let text = |v: Option<&str>| match v {
        // A NUL would end the query string early; bound, it is refused.
        Some(v) if v.contains('\0') => None,
        Some(v) => {
            let tag = dollar_tag(&[v]);
            Some(format!("{tag}{v}{tag}::text"))
        }
        None => Some("NULL::text".to_owned()),
    };
    match arg {
        Arg::Text(v) => text(*v),
        Arg::Owned(v) => text(v.as_deref()),
        // Quoted: `-9223372036854775808::int8` would cast before negating.
        Arg::Int(Some(v)) => Some(format!("'{v}'::int8")),
        Arg::Int(None) => Some("NULL::int8".to_owned()),
        Arg::Bool(v) => Some(format!("{v}::bool")),
    }
}

/// `EXECUTE name(...)` of a statement prepared on the connection, with
/// `args` written in; None when one of them cannot be written so.
pub fn execute(name: &str, args: &[Arg<'_>]) -> Option<String> {
    let args: Option<Vec<String>> = args.iter().map(literal).collect();
    Some(format!("EXECUTE {name}({})", args?.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::db::Stmt;

    #[test]
    fn the_dollar_quote_tag_is_one_no_value_contains() {
        assert_eq!(dollar_tag(&["{\"a\":\"$1\"}"]), "$hf$");
        assert_eq!(dollar_tag(&["x$hf$y", "$hf1$"]), "$hf2$");
    }

    #[test]
    fn arguments_become_typed_literals() {
        let args = Stmt::new("")
            .text("it's $hf$ here")
            .int(i64::MIN)
            .opt_text(None)
            .opt_int(None)
            .flag(true)
            .owned(Some("x".into()))
            .args;
        assert_eq!(
            execute("p", &args).as_deref(),
            Some(
                "EXECUTE p($hf1$it's $hf$ here$hf1$::text, '-9223372036854775808'::int8, \
                 NULL::text, NULL::int8, true::bool, $hf$x$hf$::text)"
            )
        );
        assert_eq!(execute("p", &[]).as_deref(), Some("EXECUTE p()"));
    }

    #[test]
    fn text_with_a_nul_is_not_written_in() {
        assert_eq!(execute("p", &Stmt::new("").text("a\0b").args), None);
    }
}
