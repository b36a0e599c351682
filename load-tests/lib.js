// Shared helpers for the k6 scenarios: node list, admin calls, voucher creation, and the
// closing check of the clients' answers against the ledger's rows (read from its change feed).
import http from 'k6/http';
import { check, fail } from 'k6';
import { Counter } from 'k6/metrics';

export const BASES = (__ENV.BASE_URLS || __ENV.BASE_URL || 'http://127.0.0.1:8080')
  .split(',')
  .map((s) => s.trim())
  .filter((s) => s.length > 0);
export const TOKEN = __ENV.ADMIN_TOKEN || '';
export const JSON_HEADERS = { 'Content-Type': 'application/json' };
// Set-up and check calls are not load: any 2xx is what they expect.
const SETUP = { responseCallback: http.expectedStatuses({ min: 200, max: 299 }), tags: { kind: 'setup' } };

// The reserve latency threshold (p99, ms). P99_MS=0 turns it off, for functional runs on a
// loaded machine (CI) where speed is measured separately, not asserted.
const P99_MS = parseInt(__ENV.P99_MS || '100', 10);
export function latencyThreshold() {
  return P99_MS > 0 ? { 'http_req_duration{kind:reserve}': [`p(99)<${P99_MS}`] } : {};
}

export function base(i) {
  return BASES[i % BASES.length];
}

function admin() {
  if (!TOKEN) fail('set ADMIN_TOKEN (the admin bearer token of the nodes)');
  return { 'Content-Type': 'application/json', Authorization: `Bearer ${TOKEN}` };
}

// Creates a voucher with a unique code and returns the code.
export function createVoucher(prefix, totalLimit, perUserLimit) {
  const code = `${prefix}-${Date.now().toString(36)}`.slice(0, 32);
  const body = {
    code,
    discountAmount: 1000,
    minOrderAmount: 0,
    totalLimit,
    perUserLimit,
    startsAt: '2020-01-01T00:00:00Z',
    endsAt: '2099-01-01T00:00:00Z',
  };
  const res = http.post(`${BASES[0]}/admin/vouchers`, JSON.stringify(body), Object.assign({ headers: admin() }, SETUP));
  if (res.status !== 201) fail(`create voucher: ${res.status} ${res.body}`);
  return code;
}

export function warm(code) {
  for (const b of BASES) {
    const res = http.post(`${b}/admin/vouchers/${code}/warm`, null, Object.assign({ headers: admin() }, SETUP));
    if (res.status !== 204) fail(`warm ${b}: ${res.status} ${res.body}`);
  }
}

export function adminView(code) {
  const res = http.get(`${BASES[0]}/admin/vouchers/${code}`, Object.assign({ headers: admin() }, SETUP));
  if (res.status !== 200) fail(`admin view: ${res.status} ${res.body}`);
  return res.json();
}

export function reserve(node, code, customerId, orderId, tags) {
  return http.post(
    `${base(node)}/vouchers/${code}/reservations`,
    JSON.stringify({ customerId, orderId, orderAmount: 10000 }),
    { headers: JSON_HEADERS, tags: Object.assign({ kind: 'reserve' }, tags || {}) },
  );
}

// The clients' own view of the books, as sets. k6 clients share nothing but metrics, so each
// client adds, for every new order it saw a 201 for (`sawCreated`), one to a count and the
// order id's fingerprint (a 20-bit hash) to a sum; a confirm or release answered 200 likewise
// (`sawSettled`). The teardown (`checkLedger`) takes away the same for every reservation the
// ledger holds for the voucher, read from the ledger's change feed (`/admin/events`: one RESERVED
// event per reservation row, then its CONFIRMED, RELEASED or EXPIRED), not from any node's own
// figures. k6 counts the teardown's samples too, so the thresholds of `ledgerMatchesClients()`
// fail the run when the ledger and the clients disagree: a 201 the ledger lost, a reservation no
// client was told of, or a lost 201 offset by such a phantom (same count, other fingerprint).
const clientsMinusLedger = new Counter('reservations_clients_minus_ledger');
const fingerprintsMinusLedger = new Counter('reservations_fingerprints_clients_minus_ledger');
const settledMinusLedger = new Counter('settled_fingerprints_clients_minus_ledger');

// FNV-1a of the order id, cut to 20 bits so that sums of millions stay exact in a double.
function fingerprint(orderId) {
  let h = 0x811c9dc5;
  for (let i = 0; i < orderId.length; i++) {
    h ^= orderId.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h & 0xfffff;
}

export function sawCreated(orderId) {
  clientsMinusLedger.add(1);
  fingerprintsMinusLedger.add(fingerprint(orderId));
}

// A confirm or release of `orderId` answered 200 (`status`: 'CONFIRMED' or 'RELEASED').
export function sawSettled(orderId, status) {
  settledMinusLedger.add(fingerprint(`${status}:${orderId}`));
}

export function ledgerMatchesClients() {
  return {
    reservations_clients_minus_ledger: ['count==0'],
    reservations_fingerprints_clients_minus_ledger: ['count==0'],
    settled_fingerprints_clients_minus_ledger: ['count==0'],
  };
}

// Every change of voucher `code` in the ledger's feed: order id → its event types, in order.
function ledgerOrders(code) {
  const orders = new Map();
  let after = 0;
  for (;;) {
    const res = http.get(`${BASES[0]}/admin/events?after=${after}&limit=1000`, Object.assign({ headers: admin() }, SETUP));
    if (res.status !== 200) fail(`feed: ${res.status} ${res.body}`);
    const page = res.json('events') || [];
    if (page.length === 0) return orders;
    for (const e of page) {
      after = e.seq;
      if (e.code !== code) continue;
      if (!orders.has(e.orderId)) orders.set(e.orderId, []);
      orders.get(e.orderId).push(e.type);
    }
  }
}

// The accounting check every scenario ends with: the ledger balances, never more than the total
// was sold, the admin view's count of reservations is the number of reservation rows the feed
// shows, and the clients' 201s, confirms and releases are settled against the feed's rows as
// above. `copies` is how many 201s each reservation answers (a retry storm sends each order
// that often).
export function checkLedger(code, expectSold, copies) {
  const v = adminView(code);
  const sold = v.reserved + v.confirmed + v.released;
  const orders = ledgerOrders(code);
  let fingerprints = 0;
  let settled = 0;
  for (const [order, types] of orders) {
    fingerprints += fingerprint(order);
    const last = types[types.length - 1];
    if (last === 'CONFIRMED' || last === 'RELEASED') settled += fingerprint(`${last}:${order}`);
  }
  clientsMinusLedger.add(-orders.size * (copies || 1));
  fingerprintsMinusLedger.add(-fingerprints * (copies || 1));
  settledMinusLedger.add(-settled);
  const ok = check(v, {
    'ledger balanced': (x) => x.balanced === true,
    'never more than totalLimit sold': (x) => x.reserved + x.confirmed <= x.totalLimit,
    'one reservation row per RESERVED event': () => sold === orders.size,
    'expected units sold': () => expectSold === undefined || sold === expectSold,
  });
  console.log(`voucher ${code}: ledger ${JSON.stringify(v.counters)}; reservation rows in the feed: ${orders.size}`);
  if (!ok) fail(`accounting check failed for ${code}: sold ${sold}, rows in the feed ${orders.size}`);
}
