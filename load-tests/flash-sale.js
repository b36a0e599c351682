// Flash sale: one voucher, distinct customers at a ramping arrival rate up to PEAK_RATE.
// Only 201 and 409 may occur. With demand above supply (the default; SELL_OUT=0 when it is not),
// the clients must see exactly TOTAL 201s (a threshold on their own count) and the ledger must
// hold exactly TOTAL reservations (teardown): sold out, nothing oversold, nothing lost.
//   k6 run -e ADMIN_TOKEN=… -e PEAK_RATE=5000 -e TOTAL=1000 load-tests/flash-sale.js
import exec from 'k6/execution';
import { check } from 'k6';
import { Counter } from 'k6/metrics';
import http from 'k6/http';
import { BASES, createVoucher, checkLedger, ledgerMatchesClients, reserve, sawCreated, warm, latencyThreshold } from './lib.js';

const TOTAL = parseInt(__ENV.TOTAL || '1000', 10);
const PEAK = parseInt(__ENV.PEAK_RATE || '5000', 10);
const HOLD = __ENV.HOLD || '10s';
const SELL_OUT = (__ENV.SELL_OUT || '1') !== '0';
const created = new Counter('reservations_created');

http.setResponseCallback(http.expectedStatuses(201, 409));

export const options = {
  scenarios: {
    flood: {
      executor: 'ramping-arrival-rate',
      startRate: Math.max(1, Math.floor(PEAK / 10)),
      timeUnit: '1s',
      preAllocatedVUs: Math.min(500, PEAK),
      maxVUs: 2000,
      stages: [
        { target: PEAK, duration: __ENV.RAMP || '3s' },
        { target: PEAK, duration: HOLD },
      ],
    },
  },
  thresholds: Object.assign(latencyThreshold(), ledgerMatchesClients(), {
    checks: ['rate==1.0'],
    http_req_failed: ['rate==0'],
    // The 201s the clients saw, counted by the clients.
    reservations_created: [SELL_OUT ? `count==${TOTAL}` : `count<=${TOTAL}`],
  }),
  summaryTrendStats: ['avg', 'p(50)', 'p(90)', 'p(99)', 'max'],
};

export function setup() {
  const code = createVoucher('FLASH', TOTAL, 1);
  warm(code);
  return { code };
}

export default function (data) {
  const customer = exec.scenario.iterationInTest + 1;
  const res = reserve(customer, data.code, customer, `${data.code}-${customer}`);
  check(res, {
    'reserve answered 201 or 409': (r) => r.status === 201 || r.status === 409,
    '409 is OUT_OF_STOCK': (r) => r.status !== 409 || r.json('error') === 'OUT_OF_STOCK',
  });
  if (res.status === 201) {
    created.add(1);
    sawCreated(`${data.code}-${customer}`);
  }
}

export function teardown(data) {
  checkLedger(data.code, SELL_OUT ? TOTAL : undefined);
}
