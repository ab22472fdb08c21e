//! Integer members of request bodies. JSON Schema counts `30000.0` as an
//! integer, and so do the clients generated from the document: accept an
//! integral number written with a fraction, refuse any other.

use serde::Deserialize;
use serde::de::{Deserializer, Error};
use serde_json::Number;

fn integral<E: Error>(n: &Number) -> Result<i64, E> {
    if let Some(i) = n.as_i64() {
        return Ok(i);
    }
    match n.as_f64() {
        Some(f) if f.fract() == 0.0 && f >= i64::MIN as f64 && f < i64::MAX as f64 =>
        {
            #[allow(clippy::cast_possible_truncation)]
            Ok(f as i64)
        }
        _ => Err(E::custom(format!("expected an integer, found {n}"))),
    }
}

pub fn i64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    integral(&Number::deserialize(d)?)
}

pub fn opt_i64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    Option::<Number>::deserialize(d)?
        .map(|n| integral(&n))
        .transpose()
}

pub fn opt_i32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i32>, D::Error> {
    opt_i64(d)?
        .map(|i| i32::try_from(i).map_err(|_| D::Error::custom(format!("{i} is out of range"))))
        .transpose()
}

/// An optional pair of ports, `[low, high]`.
pub fn opt_port_pair<'de, D: Deserializer<'de>>(d: D) -> Result<Option<[u16; 2]>, D::Error> {
    let Some([a, b]) = Option::<[Number; 2]>::deserialize(d)? else {
        return Ok(None);
    };
    let port = |n: &Number| {
        let i = integral::<D::Error>(n)?;
        u16::try_from(i).map_err(|_| D::Error::custom(format!("{i} is not a port number")))
    };
    Ok(Some([port(&a)?, port(&b)?]))
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct T {
        #[serde(deserialize_with = "super::i64")]
        a: i64,
        #[serde(default, deserialize_with = "super::opt_i64")]
        b: Option<i64>,
        #[serde(default, deserialize_with = "super::opt_i32")]
        c: Option<i32>,
        #[serde(default, deserialize_with = "super::opt_port_pair")]
        r: Option<[u16; 2]>,
    }

    fn parse(s: &str) -> Result<T, serde_json::Error> {
        serde_json::from_str(s)
    }

    #[test]
    fn integral_numbers_with_a_fraction_are_integers() {
        let t =
            parse(r#"{"a": 30000.0, "b": 2, "c": -1.0, "r": [20000.0, 29999]}"#).expect("integers");
        assert_eq!(
            (t.a, t.b, t.c, t.r),
            (30000, Some(2), Some(-1), Some([20000, 29999]))
        );
        // Large integral numbers in any JSON spelling (parsed exactly: serde_json's
        // float_roundtrip).
        for big in [
            "2251799813685247.0",
            "2.251799813685247e15",
            "22517998136852470e-1",
        ] {
            let t = parse(&format!(r#"{{"a": {big}}}"#)).expect(big);
            assert_eq!(t.a, 2_251_799_813_685_247, "{big}");
        }
        let t = parse(r#"{"a": 1, "b": null}"#).expect("null is absent");
        assert_eq!((t.b, t.c), (None, None));
    }

    #[test]
    fn other_numbers_and_types_are_refused() {
        assert!(parse(r#"{"a": 1.5}"#).is_err());
        assert!(parse(r#"{"a": "1"}"#).is_err());
        assert!(parse(r#"{"a": 1e300}"#).is_err());
        assert!(parse(r#"{"a": 1, "c": 3000000000}"#).is_err());
        assert!(parse(r#"{"a": 1, "r": [1, 70000]}"#).is_err());
        assert!(parse(r#"{"a": 1, "r": [1]}"#).is_err());
    }
}
