//! How the trace names events, commands and replies.

use super::*;

pub(super) fn event_name(e: &Event<Tag, ()>) -> String {
    match e {
        Event::Reserve(r, _) => format!("reserve {} (customer {})", r.order_id, r.customer_id),
        Event::Committed { id, res } => format!("committed batch {id}: {res:?}"),
        Event::Granted(res) => format!("granted {res:?}"),
        Event::Renewed(res) => format!("renewed {res:?}"),
        Event::LookedUp(res) => format!(
            "looked up {}",
            res.as_ref()
                .map_or("failed".into(), |a| format!("{} answers", a.len()))
        ),
        Event::WinnersLoaded(v, res) => format!(
            "winners {v:?} {}",
            res.as_ref()
                .map_or("failed".into(), |w| format!("{} orders", w.len()))
        ),
        Event::VoucherRead { first, res } => {
            format!("voucher read (first {first}) ok {}", res.is_ok())
        }
        Event::Opened(Ok(o)) => format!(
            "opened: voucher {}, granted {:?}",
            o.voucher.is_some(),
            o.grant
        ),
        Event::Opened(Err(e)) => format!("opened: failed {e:?}"),
        other => format!("{other:?}"),
    }
}

pub(super) fn command_name(c: &Command<Tag, ()>) -> String {
    match c {
        Command::Answer((client, _), reply) => {
            format!("answer client {client}: {}", reply_name(reply))
        }
        Command::Commit { id, batch } => format!(
            "commit batch {id} on lease {}: {}",
            batch.lease_id,
            batch
                .rows
                .iter()
                .map(|r| r.order_id.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        ),
        other => format!("{other:?}"),
    }
}

pub(super) fn reply_name(r: &Reply) -> String {
    match r {
        Ok(x) if x.replayed => format!("201 (replay) {}", x.reservation.order_id),
        Ok(x) => format!("201 {}", x.reservation.order_id),
        Err(e) => format!("{e:?}"),
    }
}
