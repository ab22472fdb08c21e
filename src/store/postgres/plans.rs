//! For tests: the indexes of leases and the plans PostgreSQL takes with
//! them on a store of many ended leases, where a wrong index costs a scan
//! of every entry; custom and generic plans both (PostgreSQL's plan cache
//! takes the generic one after five executions).

use sqlx::{Connection, PgConnection};

use super::renewals::RENEW_ONE;
use crate::store::sql::{CURRENT_LEASES, ENDED_LEASES};

/// A scratch store of `ENDED_LEASES` and `CURRENT_LEASES`, analyzed.
async fn filled() -> Option<PgConnection> {
    let url = super::scratch::database().await?;
    let mut c = PgConnection::connect(&url).await.expect("connect");
    for sql in [ENDED_LEASES, CURRENT_LEASES, "ANALYZE leases"] {
        sqlx::query(sql).execute(&mut c).await.expect(sql);
    }
    Some(c)
}

/// `sql` prepared on `c` as `name`, and the scans of both plans of
/// `EXECUTE name(args)`, each with the plan's lines joined.
async fn scans(
    c: &mut PgConnection,
    name: &str,
    sql: &str,
    args: &str,
) -> Vec<(String, Vec<String>)> {
    let prepare = format!("PREPARE {name} AS {sql}");
    sqlx::raw_sql(&prepare)
        .execute(&mut *c)
        .await
        .expect("prepare");
    let execute = format!("EXECUTE {name}({args})");
    let mut out = Vec::new();
    for mode in ["force_custom_plan", "force_generic_plan"] {
        let set = format!("SET plan_cache_mode = {mode}");
        sqlx::raw_sql(&set).execute(&mut *c).await.expect("set");
        let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {execute}"))
            .fetch_all(&mut *c)
            .await
            .expect("explain");
        let scans = plan
            .iter()
            .filter(|l| l.contains("Scan"))
            .cloned()
            .collect();
        out.push((format!("{mode}:\n{}", plan.join("\n")), scans));
    }
    out
}

/// A renewal must find its row by the primary key. The function's
/// statement is built of the same `renewable!`. With the state tested as
/// `lease_current!` does, both plans scanned `leases_current_expiry` (since
/// dropped) instead.
#[tokio::test]
async fn a_renewal_finds_its_lease_by_the_primary_key_among_many_ended_ones() {
    let Some(mut c) = filled().await else {
        return;
    };
    let plans = scans(&mut c, "renew_one", RENEW_ONE, "'current', 1, NULL, 2000").await;
    for (plan, scans) in plans {
        assert!(
            !scans.is_empty() && scans.iter().all(|l| l.contains("leases_pkey")),
            "every scan by the primary key: {plan}"
        );
    }
    // And it still re-checks the row: only the current lease, with its
    // token, before it expires.
    for (id, token, now, renews) in [
        ("ended-1", 1, 0, false),
        ("owned", 1, 0, false),
        ("current", 2, 2000, false),
        ("current", 1, 2000, true),
        ("current", 1, 3000, false),
    ] {
        let rows = sqlx::query(RENEW_ONE)
            .bind(id)
            .bind(token)
            .bind(None::<i64>)
            .bind(now)
            .fetch_all(&mut c)
            .await
            .expect("renew");
        assert_eq!(
            rows.len(),
            usize::from(renews),
            "{id} token {token} at {now}"
        );
    }
    let _ = c.close().await;
}

/// The reconciler's pass reads the current leases only, through the
/// partial indexes that hold them: with `leases_current_expiry` gone
/// (migration 5), its expired half goes through `leases_one_current`.
#[tokio::test]
async fn the_reconcilers_pass_reads_only_the_partial_indexes_of_current_leases() {
    let Some(mut c) = filled().await else {
        return;
    };
    let sql = crate::store::rows::TO_RECONCILE;
    for (plan, scans) in scans(&mut c, "to_reconcile", sql, "6000").await {
        assert!(
            scans.len() == 2
                && scans.iter().all(|l| {
                    l.contains("leases_one_current") || l.contains("leases_current_owned")
                }),
            "both halves through the partial indexes: {plan}"
        );
    }
    for (now, want) in [(4000, vec!["owned"]), (6000, vec!["current", "owned"])] {
        let mut ids: Vec<String> = sqlx::query_scalar(&format!("SELECT id FROM ({sql}) AS r"))
            .bind(now)
            .fetch_all(&mut c)
            .await
            .expect("to reconcile");
        ids.sort();
        assert_eq!(ids, want, "at {now}");
    }
    let _ = c.close().await;
}

/// A renewal sets these columns: while an index holds one, PostgreSQL
/// cannot update the row in place (HOT), and each renewal writes an
/// entry in every index of leases (see migrations/postgres/0005).
#[tokio::test]
async fn no_index_of_leases_holds_what_a_renewal_sets() {
    let Some(url) = super::scratch::database().await else {
        return;
    };
    let mut c = PgConnection::connect(&url).await.expect("connect");
    let defs: Vec<String> =
        sqlx::query_scalar("SELECT indexdef FROM pg_indexes WHERE tablename = 'leases'")
            .fetch_all(&mut c)
            .await
            .expect("indexes");
    crate::store::sql::assert_no_index_holds_renewal_columns(&defs);
    let _ = c.close().await;
}
