//! The context every transaction script runs in, and what the services'
//! scripts share below them. No domain owns it: leases, processes and ports
//! all depend on it, it depends on none of them.

#[cfg(test)]
pub(crate) mod fixture;
pub mod ports;

use crate::host::Host;
use crate::time::Millis;

/// The state a mutation runs in: one host, one instant.
#[derive(Clone, Copy)]
pub struct Ctx<'h> {
    pub host: &'h dyn Host,
    pub now: Millis,
}

/// Run `$body` in a write transaction of `$self.store`, with a `Ctx` on
/// `$self.host` at the instant the transaction runs (not when it was asked).
macro_rules! in_tx {
    ($self:ident, $durable:expr, |$tx:ident, $cx:ident| $body:expr) => {{
        let host = $self.host.clone();
        $self
            .store
            .write($durable, move |$tx| {
                Box::pin(async move {
                    let $cx = $crate::tx::Ctx {
                        host: host.as_ref(),
                        now: $crate::time::now_ms(),
                    };
                    $body.await
                })
            })
            .await
    }};
}
pub(crate) use in_tx;
