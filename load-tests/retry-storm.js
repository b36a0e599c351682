// Retry storm: every order is sent by many clients at once; each order must take one unit and
// every copy must get the same 201.
//   k6 run -e ADMIN_TOKEN=… -e ORDERS=200 -e COPIES=10 load-tests/retry-storm.js
import exec from 'k6/execution';
import { check } from 'k6';
import http from 'k6/http';
import { createVoucher, checkLedger, ledgerMatchesClients, reserve, sawCreated, warm } from './lib.js';

const ORDERS = parseInt(__ENV.ORDERS || '200', 10);
const COPIES = parseInt(__ENV.COPIES || '10', 10);

http.setResponseCallback(http.expectedStatuses(201));

export const options = {
  scenarios: {
    storm: {
      executor: 'per-vu-iterations',
      vus: ORDERS * COPIES > 1000 ? 1000 : ORDERS * COPIES,
      iterations: Math.ceil((ORDERS * COPIES) / Math.min(1000, ORDERS * COPIES)),
      maxDuration: '60s',
    },
  },
  thresholds: Object.assign(ledgerMatchesClients(), {
    checks: ['rate==1.0'],
    http_req_failed: ['rate==0'],
  }),
  summaryTrendStats: ['avg', 'p(50)', 'p(90)', 'p(99)', 'max'],
};

export function setup() {
  // Enough units for every order: none may run out, so every copy must get 201.
  const code = createVoucher('STORM', ORDERS, 1);
  warm(code);
  return { code };
}

export default function (data) {
  const n = exec.scenario.iterationInTest;
  if (n >= ORDERS * COPIES) return;
  const order = n % ORDERS;
  const res = reserve(n, data.code, order + 1, `${data.code}-${order}`);
  check(res, {
    'every copy 201': (r) => r.status === 201,
    'same order id back': (r) => r.status !== 201 || r.json('orderId') === `${data.code}-${order}`,
  });
  // Every copy counts: the teardown expects COPIES 201s per reservation in the ledger.
  if (res.status === 201) sawCreated(`${data.code}-${order}`);
}

export function teardown(data) {
  // One unit per order however many copies were sent; the servers created exactly ORDERS.
  checkLedger(data.code, ORDERS, COPIES);
}
